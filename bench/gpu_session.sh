#!/usr/bin/env bash
# A GPU session: `bash bench/gpu_session.sh` (first, at most 8 minutes), then `bash bench/gpu_session.sh second`
# (at most 5 minutes) for what the first could not fit; `--smoke` runs the same sequencing on CPU in seconds.
# Everything lands under $OUT (default ./gpu-out); see bench/gpu_session.py for the sections and their deadlines.
# Liger and Cut Cross-Entropy rows and flash-linear-attention (Qwen3.5's Gated DeltaNet) need their wheels
# (../shared/gpu/wheels, copied into .gpuref and carried): they are installed into .gpusite when present.
set -uo pipefail
cd "$(dirname "$0")/.."
stamp=.gpusite/.wheels-$(ls .gpuref/wheels 2>/dev/null | md5sum | cut -c1-12)
if [ -d .gpuref/wheels ] && [ ! -e "$stamp" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .gpusite .gpuref/wheels/*.whl \
    && touch "$stamp" || echo "gpu_session: wheels not installed"
fi
mkdir -p .gpucache
export PYTHONPATH=.gpusite:.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$PWD/.gpucache/inductor TRITON_CACHE_DIR=$PWD/.gpucache/triton
# the GPU image lacks parts of the test extra (trl, mypy): their tests skip there instead of stopping the run
export ZOO_TESTS_PARTIAL_EXTRA=1
export TRITON_CACHE_AUTOTUNING=1  # fla's autotuned kernels tuned once per machine, not once per process
exec python3 bench/gpu_session.py "$@"
