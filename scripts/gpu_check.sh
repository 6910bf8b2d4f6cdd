#!/usr/bin/env bash
# `make gpu-check`: lowcomm on one GPU, in under 5 minutes, from the source tree (PYTHONPATH=src)
# with the machine's own torch, transformers and pytest; installs nothing but the wheels in
# .whl/ (torchft for the elastic tests: `make gpu-wheels` on a machine with pip's index).
# Each part's output goes to $OUT/PART.out, every part's stderr to $OUT/stderr.log (default
# OUT: runs/gpu-check); the last lines are one table.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/lowcomm-site \
    .whl/*.whl >>"$OUT/stderr.log" 2>&1 && export PYTHONPATH=src:/tmp/lowcomm-site
fi
$PY - <<'PY'
import torch
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
results=()
step() {  # step NAME TIMEOUT COMMAND...: run it, log it, keep its status for the table
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name" >>"$OUT/stderr.log"
  timeout "$limit" "$@" >"$OUT/$name.out" 2> >(tee -a "$OUT/stderr.log" | tail -n 12 >&2)
  local rc=$?
  results+=("| $name | $([ $rc = 0 ] && echo ok || echo "FAILED ($rc)") | $((SECONDS - t0)) s |")
  echo "== $name (rc $rc)"; tail -n 6 "$OUT/$name.out"
}
# the parts, in this order unless PARTS names some (e.g. PARTS="tests codecs")
PARTS=${PARTS:-"codec-tests codecs sync-world1 sync-shared tests"}
workers=$($PY -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
timeout_flag=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout 150" || echo "")
for part in $PARTS; do
  case $part in
    codec-tests) step codec-tests 150 $PY -m pytest -q -p no:cacheprovider -k cuda \
      tests/test_codecs.py tests/test_compensation.py tests/test_topk_many.py \
      tests/test_block_many.py tests/test_triton.py ;;
    codecs) for n in 16777216 134217728; do
        step codecs-$n 45 $PY -m lowcomm.lab bench codecs --device cuda --no-mix --repeats 5 \
          --codecs fp32,bf16,int8,int4,fp4,topk --numel $n --json
      done ;;
    sync-world1) step sync-world1 180 $PY -m lowcomm.lab bench sync --device cuda --world 1 \
      --steps 100 --launches --json ;;
    sync-shared) step sync-shared 100 $PY -m lowcomm.lab bench sync --device cuda --world 2 \
      --steps 60 --strategies diloco,sparseloco --json ;;
    state-cpu) step state-cpu 120 $PY -m lowcomm.lab bench sync --device cuda --world 1 \
      --steps 60 --strategies diloco,sparseloco --state-device cpu --json ;;
    diagnose) step diagnose 240 $PY -m lowcomm.lab bench sync --device cuda --world 1 \
      --diagnose sparseloco --json ;;
    tests) step tests 200 $PY -m pytest -v -p no:cacheprovider -p no:benchmark -m cuda \
      $workers $timeout_flag --durations=0 tests/test_cuda.py ;;
  esac
done
$PY - "$OUT" <<'PY'
import json, pathlib, sys
from lowcomm.lab.bench.gpu import table
out = pathlib.Path(sys.argv[1])
def read(name):
    try:
        return json.loads((out / f"{name}.out").read_text())
    except (OSError, ValueError):
        return None
codecs = (read("codecs-16777216") or []) + (read("codecs-134217728") or [])
if codecs:
    print("\n| codec | numel | encode × copy | decode × copy |\n|---|---|---|---|")
    for r in codecs:
        fused = " (Triton)" if r.get("triton") else ""
        print(f"| {r['codec']}{fused} | {r['numel']:,} | {r['encode_vs_copy']:.3f} | "
              f"{r['decode_vs_copy']:.3f} |")
for name in ("sync-world1", "sync-shared", "state-cpu"):
    res = read(name)
    if res and "rows" in res:
        print(f"\n{name}: {res['device']}, torch {res['torch']}, {res['tensors']} tensors, "
              f"Triton {'on' if res.get('triton') else 'off'}")
        print(table(res))
for d in (read("diagnose") or {}).get("diagnoses", []):
    sites = sorted(d["sync_sites"].items(), key=lambda kv: -kv[1])[:12]
    print(f"\n{d['strategy']}: {d['host_syncs']} host syncs in one sync step: {sites}")
    for e in d["by_device"][:10]:
        print(f"  {e['device_ms']:8.2f} ms device {e['self_cpu_ms']:8.2f} ms cpu "
              f"x{e['count']:<5d} {e['name'][:60]}")
PY
printf '\n| part | result | time |\n|---|---|---|\n'
printf '%s\n' "${results[@]}"
