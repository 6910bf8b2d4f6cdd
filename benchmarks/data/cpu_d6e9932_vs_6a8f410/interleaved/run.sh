#!/bin/bash
# interleaved before/after, one at a time
OUT=/tmp/cpu_ab; mkdir -p $OUT
PY=/work/main/.venv/bin/python
for i in 1 2; do
  for side in before after; do
    PYTHONPATH=/tmp/$side/src THP_MEM_ALLOC_ENABLE=1 $PY -m lowcomm.cli bench codecs --json > $OUT/codecs_${side}_$i.json 2> $OUT/codecs_${side}_$i.err
  done
  for side in before after; do
    PYTHONPATH=/tmp/$side/src $PY -m lowcomm.cli bench sync --model base --json > $OUT/sync_${side}_$i.json 2> $OUT/sync_${side}_$i.err
  done
done
echo done > $OUT/DONE
