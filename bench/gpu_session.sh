#!/usr/bin/env bash
# Everything a session with one GPU checks and measures, in parts that each fit one 10-minute device call, logs and
# JSON under $OUT (or ./gpu-out). Run from the repository root:
#   bash bench/gpu_session.sh check     # tests marked gpu, then every bench path at tiny shapes     (~3-5 min)
#   bash bench/gpu_session.sh train     # bench_gpu correct, loss, step (+ compiled), lora            (~6-8 min)
#   bash bench/gpu_session.sh long      # bench_gpu long, attn; bench_generate                        (~5-7 min)
#   bash bench/gpu_session.sh suite     # the whole test suite on the GPU machine                     (~5 min)
# Liger and Cut Cross-Entropy rows need their wheels (../shared/gpu/wheels, copied into .gpuref and carried):
# they are installed into .gpusite when present. Each part writes nvidia-smi, versions and its command first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
part=${1:?which part: check, train, long or suite}
if [ -d .gpuref/wheels ] && [ ! -d .gpusite ]; then
  python3 -m pip install -q --no-index --no-deps --target .gpusite .gpuref/wheels/*.whl || true
fi
export PYTHONPATH=.gpusite:.${PYTHONPATH:+:$PYTHONPATH}
log="$OUT/$part.log"
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)"
  echo "part: $part"
} >"$log" 2>&1
run() {  # one command, its exit status and wall time in the log; the next runs whatever happened
  echo -e "\n\$ $*" >>"$log"
  local t0=$SECONDS
  "$@" >>"$log" 2>&1
  echo "exit $? after $((SECONDS - t0)) s: $*" | tee -a "$log" "$OUT/summary.txt"
}
case $part in
  check)
    run python3 -m pytest -q -m gpu tests -x -p no:cacheprovider
    run python3 bench/bench_gpu.py --smoke --device cuda --out "$OUT/smoke.json"
    run python3 bench/bench_generate.py --smoke --device cuda --compile
    ;;
  train)
    run python3 bench/bench_gpu.py --only correct,loss,lora --out "$OUT/train.json"
    run python3 bench/bench_gpu.py --only step --compile --out "$OUT/step.json"
    ;;
  long)
    run python3 bench/bench_gpu.py --only long,attn --out "$OUT/long.json"
    run python3 bench/bench_generate.py --device cuda --compile --out "$OUT/generate.json"
    ;;
  suite)
    run python3 -m pytest -q tests -p no:cacheprovider -n 8
    ;;
  *)
    echo "unknown part $part: check, train, long or suite" >&2
    exit 2
    ;;
esac
