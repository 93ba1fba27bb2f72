#!/usr/bin/env bash
# One call on a 2-GPU machine (nvidia-h200-x2): every GPU check and the key benchmarks.
#   bash benchmarks/gpu_verify.sh          (carry ".whl"; logs and JSON land in $OUT)
# Order: what proves correctness first (tests, check, demo over NCCL, examples), then speed.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TQDM_MININTERVAL=30
exec > >(tee -a "$OUT/verify.log") 2>&1
t0=$(date +%s)
stamp() { echo "=== [$(( $(date +%s) - t0 )) s] $*"; }

stamp install
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import torch, triton, flashinfer, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))"

stamp "jit warm"
pids=()
for w in "mla bfloat16" "mla float16" "gqa bfloat16" "gqa float16"; do
  timeout 300 python3 benchmarks/jit_warm.py $w >> "$OUT/jit.log" 2>&1 &
  pids+=($!)
done
# Wait for these pids only: a bare `wait` also waits for the tee above, which never ends (hung a whole call).
for p in "${pids[@]}"; do wait "$p"; done
grep -h "ready\|Error" "$OUT/jit.log" | tail -n 6

stamp "one-GPU tests (backends x fused/unfused query, NaN caches, graphs; Triton kernels on CUDA)"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/test_backends_gpu.py \
  --timeout 200 2>&1 | grep -v "^SKIPPED" | tail -25
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_merge.py tests/test_kernels_query_merge.py \
  --timeout 100 2>&1 | grep -v "^SKIPPED" | tail -8

stamp "check"
timeout 120 python3 -m twostage_mla check 2>&1 | grep -v "skipped" | tail -20

stamp "demo: N=2 over NCCL, auto backend"
for combine in a2a ag_rs; do
  timeout 120 python3 -m twostage_mla demo --world-size 2 --combine $combine --json > "$OUT/demo_$combine.json" 2> "$OUT/demo_$combine.err"
  echo "rc=$?"; head -c 700 "$OUT/demo_$combine.json"; echo; tail -3 "$OUT/demo_$combine.err"
done
timeout 120 python3 -m twostage_mla demo --world-size 2 --interleave 16 2>&1 | grep -v USDT | tail -12

stamp "torchrun example on 2 GPUs"
timeout 120 torchrun --nproc-per-node 2 examples/torchrun_dcp_step.py --cuda 2>&1 | grep "rank\|Error" | tail -4

stamp "bench: B=32, FlashInfer query pass vs the fused Triton one"
timeout 240 python3 -m twostage_mla bench --batch 32 --context 1K,8K,32K,128K --q-len 4,8 --heads 16,128 \
  --backends flashinfer --fused --out "$OUT/bench_fused.json" 2>&1 | tail -45

stamp "DeepSeek-V3 (transformers) on 2 GPUs, real attention dims"
timeout 150 python3 examples/deepseek_v3_dcp.py --device cuda --world-size 2 --interleave 4 --real-dims \
  --dtype bfloat16 --max-new-tokens 12 2>&1 | tail -12

stamp "prefill cost: gather KV vs split, 2 GPUs"
timeout 150 python3 benchmarks/prefill_cost.py --out "$OUT/prefill_cost.json" 2>&1 | tail -30
stamp done
