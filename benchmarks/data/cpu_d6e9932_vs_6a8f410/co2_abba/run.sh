#!/bin/bash
OUT=/tmp/abba_co2; mkdir -p $OUT
PY=/work/main/.venv/bin/python
i=0
for side in after before before after after before before after; do
  i=$((i+1))
  PYTHONPATH=/tmp/$side/src $PY -m lowcomm.cli bench sync --model base --strategies co2 --repeats 10 --json > $OUT/sync_${i}_${side}.json 2> $OUT/sync_${i}_${side}.err
done
echo done > $OUT/DONE
