#!/usr/bin/env bash
# One GPU-machine session: install FlashInfer from ./.whl, build its kernels in parallel,
# run the GPU tests (one GPU, then two if present), then the benchmark.
#   bash benchmarks/gpu_session.sh [bench args...]        (carry ".whl"; files land in $OUT)
# Knobs (environment): JIT="mla bfloat16;mla float16;gqa bfloat16;gqa float16" (FlashInfer modules to
# build up front, in parallel); TEST_K (pytest -k for the one-GPU tests; "skip" skips them);
# MULTI=0 skips the two-GPU test; BENCH_TIMEOUT (s).
# Files under $OUT: session.log, jit.log, bench.json, bench.png.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TQDM_MININTERVAL=10
exec > >(tee -a "$OUT/session.log") 2>&1
t0=$(date +%s)
stamp() { echo "=== [$(( $(date +%s) - t0 )) s] $*"; }

stamp install
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "WHEEL INSTALL FAILED"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || echo "FLASHINFER IMPORT FAILED"

stamp "jit warm: ${JIT=mla bfloat16;mla float16;gqa bfloat16;gqa float16}"
pids=()
IFS=';' read -ra jobs <<< "$JIT"
for w in "${jobs[@]}"; do
  timeout 420 python3 benchmarks/jit_warm.py $w >> "$OUT/jit.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
stamp "jit done"; grep -h "ready\|Error" "$OUT/jit.log" | tail -n 8

if [ "${TEST_K:-}" != "skip" ]; then
  stamp "one-GPU tests -k '${TEST_K:-all but two_gpus and the head counts other than 128}'"
  timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backends_gpu.py -k "${TEST_K:-not two_gpus and (not head_counts or (mla-128x1 and chain))}" --timeout 240 -rs 2>&1 | grep -v "^SKIPPED" | tail -40
fi
if [ "${MULTI:-1}" != "0" ] && [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  stamp "two-GPU NCCL test"
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/test_backends_gpu.py -k two_gpus --timeout 230 2>&1 | grep "rank\|passed\|failed\|Error\|assert" | tail -30
fi

stamp "bench $*"
timeout ${BENCH_TIMEOUT:-400} python3 -m twostage_mla bench --out "$OUT/bench.json" "$@" 2>&1 | tail -170
stamp done
