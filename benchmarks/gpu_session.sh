#!/usr/bin/env bash
# One GPU-machine session: install FlashInfer from ./.whl, build its kernels in parallel,
# run the GPU tests (one GPU, then two if present), then the benchmark.
#   run with: bash benchmarks/gpu_session.sh [bench args...]     (carry ".whl"; $OUT collects logs)
# Files under $OUT: session.log, jit.log, bench.json, bench.png (at most 8 come back).
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

if [ -z "${SKIP_TESTS:-}" ]; then
  stamp "jit warm (background, parallel)"
  pids=()
  for w in "mla bfloat16" "mla float16" "gqa bfloat16" "gqa float16"; do
    timeout 420 python3 benchmarks/jit_warm.py $w >> "$OUT/jit.log" 2>&1 &
    pids+=($!)
  done
  stamp "gpu tests without flashinfer (while it builds)"
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backends_gpu.py -k "not flashinfer and not two_gpus" --timeout 240 -rs 2>&1 | tail -40
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_merge.py 2>&1 | tail -5
  for p in "${pids[@]}"; do wait "$p"; done
  stamp "jit done"; tail -n 8 "$OUT/jit.log"
  stamp "gpu tests with flashinfer"
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backends_gpu.py -k "flashinfer and not two_gpus" --timeout 240 -rs 2>&1 | tail -40
  if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    stamp "two-gpu nccl test"
    timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/test_backends_gpu.py -k two_gpus --timeout 220 2>&1 | tail -30
  fi
  timeout 120 python3 -m twostage_mla check --device cuda 2>&1 | tail -20
fi

stamp "bench $*"
timeout ${BENCH_TIMEOUT:-400} python3 -m twostage_mla bench --out "$OUT/bench.json" "$@" 2>&1 | tail -150
stamp done
