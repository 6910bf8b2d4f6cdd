#!/bin/bash
OUT=/tmp/co2_ab2; mkdir -p $OUT
PY=/work/main/.venv/bin/python
for i in 1 2 3 4; do
  for side in before after; do
    PYTHONPATH=/tmp/$side/src $PY -m lowcomm.cli bench sync --model base --strategies co2,diloco --repeats 10 --json > $OUT/sync_${side}_$i.json 2> $OUT/sync_${side}_$i.err
  done
done
echo done > $OUT/DONE
