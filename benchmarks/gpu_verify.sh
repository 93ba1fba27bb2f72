#!/usr/bin/env bash
# GPU checks and benchmarks on a 2-GPU machine (nvidia-h200-x2), in calls of under ten minutes each:
#   bash benchmarks/gpu_verify.sh correct   # sweep of the fused kernel's launch shape, one- and two-GPU tests,
#                                           # Triton kernel tests, check, demo and torchrun example over NCCL
#   bash benchmarks/gpu_verify.sh speed     # sweep + CUDA tests of the fused kernel, bench B=32 (FlashInfer query
#                                           # pass vs fused), prefill cost, then DeepSeek-V3 real dims on 2 GPUs,
#                                           # demo with I=16 and check, at once
#   bash benchmarks/gpu_verify.sh final     # what those two left: DeepSeek-V3 fp32/bf16 over NCCL, prefill cost
#                                           # under CUDA graphs, the fused kernel's
#                                           # GPU tests (one GPU, and two over NCCL), demo with the fused default
#   bash benchmarks/gpu_verify.sh kernel    # one GPU: the fused kernel's launch-shape sweep (against the kernel in
#                                           # benchmarks/_query_merge_prev.py where that file is), its CUDA
#                                           # tests and layer tests against the oracle, bench B=32 fused vs unfused
#   bash benchmarks/gpu_verify.sh grid      # one GPU: a short launch-shape sweep, kernel tests, the issue's whole
#                                           # bench grid (fused default and unfused), twostage-mla check
#   bash benchmarks/gpu_verify.sh tests     # kernel tests, the whole one-GPU test file, the two-GPU NCCL test
#                                           # where there are two GPUs (and benchmarks/context_probe.py on the
#                                           # second GPU meanwhile), twostage-mla check
#   bash benchmarks/gpu_verify.sh bench     # one GPU: the issue's whole bench grid alone (fused default and unfused)
#   bash benchmarks/gpu_verify.sh layer     # what a change outside the kernels needs, then `main`: the
#                                           # one-GPU test file but its head counts (128 heads kept),
#                                           # twostage-mla check
#   bash benchmarks/gpu_verify.sh heads [mla|gqa|EXPR]  # one GPU: the layer at MLA head counts 1 - 1024, GQA
#                                           # head dims 64 - 256, every backend but the reference, or any pytest
#                                           # -k EXPR (a call each: FlashInfer builds); with MLA, where FlashInfer's
#                                           # causal MLA kernel is exact (benchmarks/fi_mla_causal_probe.py)
#   bash benchmarks/gpu_verify.sh main      # two GPUs (one where there is one): the README's demo over NCCL (both
#                                           # combines, I = 16), the torchrun example
#   bash benchmarks/gpu_verify.sh model     # DeepSeek-V3 real dims over NCCL, float32, a chain and a tree
#   bash benchmarks/gpu_verify.sh recheck   # one GPU: the kernel alone against benchmarks/_query_merge_prev.py,
#                                           # bench at B = 32 (Q = 4, 8), twostage-mla check
#   bash benchmarks/gpu_verify.sh suite [1|2]  # one GPU: the CPU suite (pytest -m "not gpu") where CUDA is present,
#                                           # so the tests that pick CUDA (Triton kernels, layer, bench) run there;
#                                           # half 1 (test files a - k, default) then half 2 (l - z, twostage-mla
#                                           # check, the README's demo on the GPU), a call each
#   bash benchmarks/gpu_verify.sh capture   # one GPU: kernel tests, the kernel with and without a causal mask,
#                                           # the layer's graph, tree, NaN and empty-row tests
#   bash benchmarks/gpu_verify.sh expand    # one GPU: bench B = 32 (C 1K - 128K, Q 1 - 8, 16 / 64 / 128 heads,
#                                           # context_pass 'auto' and the split where it expands), then the
#                                           # one-GPU tests of the expanded pass, graphs and the oracle grid;
#                                           # BATCH=1,8,32,64 HEADS=16,128 BENCH_S=450: the issue's whole grid;
#                                           # LONG_BUDGET=S: then B = 32, Q = 4, 8 again with S s of rounds a point
#   bash benchmarks/gpu_verify.sh capacity  # one GPU: FlashInfer's MLA planner past 16384 work items, the layer's
#                                           # refusal, bench at B = 32, Q = 4 with FlashInfer
#   bash benchmarks/gpu_verify.sh release VERSION [EXPR]  # the same with another FlashInfer release (from
#                                           # fi_release_pack.sh), and between them FlashInfer's tests of the
#                                           # one-GPU test file (-k "flashinfer and (EXPR)", by default all but
#                                           # the head counts other than 128) and check; BENCH=0: no bench
# FI=VERSION before any part runs it with that FlashInfer release (from fi_release_pack.sh) in place of 0.5.3.
# On one GPU (nvidia-h200) speed and final skip what needs two.
# Carry ".whl" (FlashInfer wheels, from ../shared/device/wheels.sh); logs and JSON land in $OUT.
set -u
part=${1:?usage: gpu_verify.sh correct|speed|final|kernel|grid|bench|tests|layer|heads|recheck|main|model|capture|suite|expand|capacity|release}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TQDM_MININTERVAL=30
exec > >(tee -a "$OUT/$part.log") 2>&1
t0=$(date +%s)
ngpu=$(nvidia-smi -L | wc -l)
stamp() { echo "=== [$(( $(date +%s) - t0 )) s] $*"; }
# Every part but `heads` leaves test_head_counts to it, but for the 128-head chain cases (what the test it
# replaced ran everywhere).
keep128="(not head_counts or (mla-128x1 and chain))"

stamp install
ver=${FI:-}  # another FlashInfer release in place of 0.5.3
[ "$part" = release ] && ver=${2:?usage: gpu_verify.sh release VERSION}
source benchmarks/_fi_site.sh
python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))"

# Wait on our own pids only: a bare `wait` also waits for the tee above, which never ends (it hung a whole call).
pids=()
# FlashInfer's builds, one after another in one background job: FlashInfer runs every module's ninja in one
# directory with one deps log, which builds at once damage, so the tests rebuilt what they had just built
# (benchmarks/jit_probe.sh, session 47).
jit() {
  (for w in "$@"; do timeout 300 python3 benchmarks/jit_warm.py $w; done >> "$OUT/jit.log" 2>&1) &
  pids+=($!)
}

kernel_tests() {  # the Triton kernels' tests on CUDA
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_merge.py tests/test_kernels_query_merge.py \
    --timeout 90 2>&1 | grep -v "^SKIPPED" | tail -4
}
check_start() {  # twostage-mla check, every backend, in the background (~190 s where FlashInfer still builds)
  timeout "${1:-300}" python3 -m twostage_mla check > "$OUT/check.log" 2>&1 &
  chk=$!
}
check_report() {
  wait "$chk"; echo "check rc=$?"; grep -v skipped "$OUT/check.log" | tail -16
}
check_all() { check_start 300; check_report; }
jit_wait() {  # the FlashInfer builds started by jit
  for p in "${pids[@]}"; do wait "$p"; done
  grep -h "ready\|Error" "$OUT/jit.log" | tail -n 8
}
deepseek() {  # SECONDS LINES ARGS...: the DeepSeek-V3 example at real dims on CUDA, then its exit status
  timeout "$1" python3 examples/deepseek_v3_dcp.py --device cuda --real-dims --max-new-tokens 12 "${@:3}" 2>&1 \
    | grep -v "Warning\|warn" | tail -"$2"
  echo "rc=${PIPESTATUS[0]}"  # the example exits 1 when its tokens or errors fail
}

if [ "$part" = expand ]; then
  jit "mla bfloat16"
  jit_wait
  jit "mla float16" "gqa bfloat16" "gqa float16"  # for the tests, while the bench runs
  stamp "bench B = 32, context_pass 'auto' and the split where it expands (FlashInfer builds meanwhile)"
  timeout "${BENCH_S:-300}" python3 -m twostage_mla bench --batch "${BATCH:-32}" --context 1K,8K,32K,128K \
    --q-len 1,2,4,8 --heads "${HEADS:-16,64,128}" --backends flashinfer --split \
    --methods twostage,onepass,expand,floor --out "$OUT/bench_expand.json" 2>&1 | tee "$OUT/bench_expand.log" \
    | tail -"${TAIL:-60}"  # the whole table in the log: the console keeps its end
  if [ -n "${LONG_BUDGET:-}" ]; then  # the target points again, with longer rounds: less timing noise
    stamp "bench B = 32, Q = 4, 8, 16 and 128 heads, --budget-s $LONG_BUDGET"
    timeout 300 python3 -m twostage_mla bench --batch 32 --context 1K,8K,32K,128K --q-len 4,8 --heads 16,128 \
      --backends flashinfer --split --budget-s "$LONG_BUDGET" --methods twostage,onepass,expand,floor \
      --out "$OUT/bench_expand_long.json" 2>&1 | tail -40
  fi
  jit_wait
  stamp "one-GPU tests: the expanded pass, graphs, the oracle grid (log: gpu_tests_expand.log)"
  timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -m "gpu and not multigpu" tests/test_backends_gpu.py \
    -k "expanded or auto_at_128 or cuda_graph_replay or backend_matches_oracle" --timeout 150 \
    > "$OUT/gpu_tests_expand.log" 2>&1
  grep -v "^SKIPPED" "$OUT/gpu_tests_expand.log" | grep -v "^  \|^$" | tail -16
elif [ "$part" = capacity ] || [ "$part" = release ]; then
  tag=$(python3 -c "import flashinfer; print(flashinfer.__version__)")
  if [ "$part" = release ]; then  # the GQA builds (~110 s) only where the tests take GQA
    case "${3:-gqa}" in *gqa*) jit "mla bfloat16" "mla float16" "gqa bfloat16" "gqa float16" ;; *) jit "mla bfloat16" ;; esac
  fi
  stamp "FlashInfer $tag's MLA planner past 16384 work items, and the layer's refusal (log: capacity_$tag.log)"
  timeout 200 python3 benchmarks/fi_mla_capacity_probe.py --out "$OUT/fi_mla_capacity_$tag.json" \
    > "$OUT/capacity_$tag.log" 2>&1
  echo "rc=$?"; tail -16 "$OUT/capacity_$tag.log" | cut -c 1-300
  if [ "$part" = release ]; then
    tests=${3:-$keep128}
    jit_wait
    stamp "FlashInfer's tests of the one-GPU test file, -k \"flashinfer and ($tests)\", check meanwhile"
    check_start 300
    timeout 330 python3 -m pytest -q -rs -p no:cacheprovider -m "gpu and not multigpu" tests/test_backends_gpu.py \
      -k "flashinfer and ($tests)" --timeout 200 > "$OUT/gpu_tests_$tag.log" 2>&1
    grep -v "^SKIPPED" "$OUT/gpu_tests_$tag.log" | grep -v "^  \|^$" | tail -24
    echo "FlashInfer deprecation warnings: $(grep -ci "deprecat" "$OUT/gpu_tests_$tag.log")"
    check_report
  fi
  [ "${BENCH:-1}" = 1 ] || { stamp done; exit 0; }
  stamp "bench with FlashInfer $tag: B = 32, Q = 4, 16 and 128 heads"
  timeout 200 python3 -m twostage_mla bench --batch 32 --context 1K,8K,32K,128K --q-len 4 --heads 16,128 \
    --backends flashinfer --methods twostage,onepass,expand,floor --out "$OUT/bench_b32_$tag.json" 2>&1 | tail -24
elif [ "$part" = grid ]; then
  jit "mla bfloat16" "mla float16" "gqa bfloat16" "gqa float16"
  stamp "fused kernel launch-shape sweep, Q=4 (FlashInfer builds in the background)"
  prev=(); [ -f benchmarks/_query_merge_prev.py ] && prev=(--prev benchmarks/_query_merge_prev.py)
  timeout 170 python3 benchmarks/query_merge_sweep.py --q-len 4 8 --block-h 16 64 --block-d 64 128 \
    --block-v 128 512 --v-stages 2 3 "${prev[@]}" --out "$OUT/query_merge_sweep.json"
  stamp "Triton kernel tests on CUDA"
  kernel_tests
  jit_wait
  stamp "bench: the issue's full grid, the default (fused) and the unfused path"
  timeout 230 python3 -m twostage_mla bench --unfused --out "$OUT/bench_grid.json" 2>&1 | tail -160
  stamp check
  timeout 100 python3 -m twostage_mla check 2>&1 | tail -16
elif [ "$part" = capture ]; then
  jit "mla bfloat16" "mla float16" "gqa bfloat16" "gqa float16"
  stamp "Triton kernel tests on CUDA (FlashInfer builds in the background)"
  kernel_tests
  stamp "the kernel alone: default launch, with and without a causal mask"
  timeout 120 python3 benchmarks/query_merge_sweep.py --block-h 64 --block-d 64 --block-v 128 --v-stages 2 \
    --out "$OUT/query_merge_mask.json"
  jit_wait
  stamp "layer: graphs (replay after a new plan, trees under capture limits), trees, NaN caches, empty rows"
  timeout 300 python3 -m pytest -q -rs -p no:cacheprovider -m "gpu and not multigpu" tests/test_backends_gpu.py \
    -k "graph or nan or empty or tree" --timeout 290 > "$OUT/gpu_tests_capture.log" 2>&1
  grep -v "^SKIPPED" "$OUT/gpu_tests_capture.log" | tail -8
elif [ "$part" = tests ]; then
  jit "mla bfloat16" "mla float16" "gqa bfloat16" "gqa float16"
  stamp "Triton kernel tests on CUDA (FlashInfer builds in the background)"
  kernel_tests
  jit_wait
  if [ "$ngpu" -ge 2 ]; then  # the context-pass probe on the second GPU while the tests hold the first
    CUDA_VISIBLE_DEVICES=1 timeout 200 python3 benchmarks/context_probe.py --out "$OUT/context_probe.json" \
      > "$OUT/context_probe.log" 2>&1 &
    probe=$!
  fi
  stamp "the whole one-GPU test file (log: gpu_tests.log)"
  CUDA_VISIBLE_DEVICES=0 timeout 270 python3 -m pytest -q -rs -p no:cacheprovider -m "gpu and not multigpu" \
    tests/test_backends_gpu.py -k "$keep128" --timeout 200 > "$OUT/gpu_tests.log" 2>&1
  grep -v "^SKIPPED" "$OUT/gpu_tests.log" | tail -8
  if [ "$ngpu" -ge 2 ]; then
    wait "$probe"
    stamp "context-pass probe (GPU 1)"
    cat "$OUT/context_probe.log" | tail -24
  fi
  if [ "$ngpu" -ge 2 ]; then
    stamp "two-GPU NCCL test"
    timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_backends_gpu.py -k two_gpus --timeout 190 \
      > "$OUT/two_gpus.log" 2>&1
    grep "rank .: \|passed\|failed\|Error\|assert" "$OUT/two_gpus.log" | tail -14
  fi
  stamp check
  check_all
elif [ "$part" = kernel ]; then
  jit "mla bfloat16"
  stamp "fused kernel launch-shape sweep (FlashInfer builds in the background)"
  prev=(); [ -f benchmarks/_query_merge_prev.py ] && prev=(--prev benchmarks/_query_merge_prev.py)
  # The whole default grid took 247 s on an H100 (session 53).
  timeout 300 python3 benchmarks/query_merge_sweep.py --q-len 4 8 "${prev[@]}" --out "$OUT/query_merge_sweep.json"
  stamp "Triton kernel tests on CUDA"
  kernel_tests
  jit_wait
  stamp "bench: B=32, the default (fused query pass) vs FlashInfer query pass + merge"
  timeout 150 python3 -m twostage_mla bench --batch 32 --context 1K,8K,32K --q-len 4,8 --heads 16,128 \
    --backends flashinfer --unfused --methods twostage,onepass,expand,floor --out "$OUT/bench_fused.json" 2>&1 | tail -40
  stamp "layer tests against the oracle with the fused kernel (MLA, flashinfer and reference; graphs, NaN, empty)"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/test_backends_gpu.py \
    -k "((fused-query and mla and (flashinfer or reference)) or graph or nan or empty) and $keep128" --timeout 100 2>&1 \
    | grep -v "^SKIPPED" | tail -8
  if [ "$ngpu" -ge 2 ]; then
    stamp "two-GPU NCCL test (the fused kernel after a2a and ag_rs)"
    timeout 250 python3 -m pytest -q -s -p no:cacheprovider tests/test_backends_gpu.py -k two_gpus --timeout 240 \
      > "$OUT/two_gpus.log" 2>&1
    grep "rank .: \|passed\|failed\|Error\|assert" "$OUT/two_gpus.log" | tail -14
  fi
elif [ "$part" = recheck ]; then
  jit "mla bfloat16"
  stamp "the kernel alone: default launch (with and without a causal mask) against the one before the review fixes"
  prev=(); [ -f benchmarks/_query_merge_prev.py ] && prev=(--prev benchmarks/_query_merge_prev.py)
  timeout 120 python3 benchmarks/query_merge_sweep.py --block-h 64 --block-d 64 --block-v 128 --v-stages 2 \
    "${prev[@]}" --out "$OUT/query_merge_recheck.json"
  jit_wait
  stamp "bench: B=32, the issue's C, Q = 4 and 8, 16 and 128 heads (FlashInfer, fused default)"
  timeout 200 python3 -m twostage_mla bench --batch 32 --context 1K,8K,32K,128K --q-len 4,8 --heads 16,128 \
    --backends flashinfer --out "$OUT/bench_recheck.json" 2>&1 | tail -40
  stamp check
  check_all
elif [ "$part" = bench ]; then
  jit "mla bfloat16"
  jit_wait
  stamp "bench: the issue's full grid, the default (fused) and the unfused path"
  timeout 400 python3 -m twostage_mla bench --unfused --out "$OUT/bench_grid.json" 2>&1 | tail -160
elif [ "$part" = suite ]; then
  # The whole suite no longer fits a call (session 20: 112 s of builds, then 276 of 366 tests in 388 s,
  # test_layer.py and the Triton kernels' tests the largest on the CPU), so it runs in two halves by file
  # name, those two apart; check (its own FlashInfer builds) runs beside the second.
  half=${2:-1}
  case "$half" in
    1) files=$(ls tests/test_[a-k]*.py) ;;
    2) files=$(ls tests/test_[l-z]*.py); check_start 400 ;;
    *) echo "usage: gpu_verify.sh suite [1|2]"; exit 2 ;;
  esac
  jit "mla bfloat16" "mla float16" "gqa bfloat16" "gqa float16"
  jit_wait
  stamp "the CPU suite with CUDA present, half $half (log: suite_pytest.log)"
  timeout 420 python3 -m pytest -q -rs -p no:cacheprovider -m "not gpu" $files --timeout 200 \
    --durations 10 > "$OUT/suite_pytest.log" 2>&1
  echo "rc=$?"; grep -v "^SKIPPED" "$OUT/suite_pytest.log" | grep -v "^  \|^$" | tail -20
  grep "^SKIPPED" "$OUT/suite_pytest.log" | cut -c1-160 | sort | uniq -c | sort -rn | head -12
  if [ "$half" = 2 ]; then
    check_report
    stamp "the README's demo on the GPU (N = 1 over NCCL)"
    timeout 90 python3 -m twostage_mla demo --world-size 1 --device cuda 2>&1 | grep -v "USDT\|warn\|func(" | tail -8
  fi
elif [ "$part" = layer ]; then
  # With the chunked-prefill and float32 tests the file and `main` no longer fit one call (session 18):
  # `main` is a call of its own after this one.
  jit "mla bfloat16" "mla float16" "gqa bfloat16" "gqa float16"
  jit_wait
  stamp "the one-GPU test file but the head counts other than 128, which are \`heads\` (log: gpu_tests.log), check meanwhile"
  check_start 300
  timeout 380 python3 -m pytest -q -rs -p no:cacheprovider -m "gpu and not multigpu" \
    tests/test_backends_gpu.py -k "$keep128" --timeout 200 > "$OUT/gpu_tests.log" 2>&1
  grep -v "^SKIPPED" "$OUT/gpu_tests.log" | grep -v "^  \|^$" | tail -30
  check_report
elif [ "$part" = heads ]; then
  # Until session 47 the GQA warm-ups ran at once and damaged FlashInfer's deps log, so the first test at
  # each head dim rebuilt its module (55 - 86 s each; docs/backends.md). Session 19 on a fresh H200:
  # `heads mla` (chains and trees) 85 s; `heads "chain and gqa"` 385 s, of which 150 s warm-up and three
  # such rebuilds. Session 48 on a fresh H100, warm-ups in turn: `heads gqa` 266 s (warm-ups 213 s, tests
  # 19 s), then 40 s on the same machine. Still one format a call: `heads mla`, then `heads gqa`.
  filter=${2:-mla}
  case "$filter" in  # build only what the filter runs: the GQA builds take up to ~220 s
    *mla*) jit "mla bfloat16" ;;
    *gqa*) jit "gqa bfloat16" "gqa bfloat16 --head-dim 64" "gqa bfloat16 --head-dim 256" ;;
    *) jit "mla bfloat16" "gqa bfloat16" "gqa bfloat16 --head-dim 64" "gqa bfloat16 --head-dim 256" ;;
  esac
  jit_wait
  stamp "the layer at MLA head counts 1 - 1024, GQA head dims 64 - 256: $filter (log: head_counts.log)"
  timeout 400 python3 -m pytest -v -rsP -p no:cacheprovider tests/test_backends_gpu.py -k "head_counts and ($filter)" \
    --timeout 200 --durations=10 > "$OUT/head_counts.log" 2>&1
  echo "rc=$?"; grep "FAILED\|Error" "$OUT/head_counts.log" | head -20; tail -16 "$OUT/head_counts.log"
  case "$filter" in gqa*|*"and gqa"*) ;; *)
    stamp "where FlashInfer's causal MLA kernel is exact (docs/backends.md; log: fi_mla_causal.log)"
    timeout 200 python3 benchmarks/fi_mla_causal_probe.py --out "$OUT/fi_mla_causal.json" > "$OUT/fi_mla_causal.log" 2>&1
    echo "rc=$?"; tail -5 "$OUT/fi_mla_causal.log" | cut -c 1-400 ;;
  esac
elif [ "$part" = main ]; then
  jit "mla bfloat16"
  jit_wait
  n=$(( ngpu >= 2 ? 2 : 1 ))  # on one GPU: N = 1 over NCCL (the README's plain command would pick the CPU)
  for combine in a2a ag_rs; do
    stamp "the README's main job: demo, N=$n over NCCL, combine $combine"
    timeout 90 python3 -m twostage_mla demo --world-size $n --device cuda --combine $combine --json \
      > "$OUT/demo_$combine.json" 2> "$OUT/demo_$combine.err"
    echo "rc=$?"; head -c 700 "$OUT/demo_$combine.json"; echo; tail -3 "$OUT/demo_$combine.err"
  done
  stamp "the demo's stderr: USDT lines and NCCL device warnings (0 expected since session 16)"
  cat "$OUT"/demo_*.err | grep -c "USDT\|Guessing device ID\|device under current context"
  stamp "demo N=$n, I=16"
  timeout 90 python3 -m twostage_mla demo --world-size $n --device cuda --interleave 16 2>&1 \
    | grep -v "USDT\|warn\|func(" | tail -12
  stamp "torchrun example on $n GPU(s)"
  timeout 90 torchrun --nproc-per-node $n examples/torchrun_dcp_step.py --cuda > "$OUT/torchrun.log" 2>&1
  echo "rc=$?"; grep "rank\|Error" "$OUT/torchrun.log" | grep -v "Guessing\|current context" | tail -4
  echo "NCCL device warnings: $(grep -c "Guessing device ID\|device under current context" "$OUT/torchrun.log")"
elif [ "$part" = model ]; then
  for opt in "--q-len 4" "--tree"; do  # float32: greedy tokens equal transformers' generate
    stamp "DeepSeek-V3 real dims, float32, N=$ngpu over NCCL, $opt"
    deepseek 150 9 --world-size "$ngpu" --interleave 4 --dtype float32 $opt
  done
elif [ "$part" = final ]; then
  jit "mla bfloat16" "gqa float16"
  stamp "Triton kernel tests on CUDA (FlashInfer builds in the background)"
  kernel_tests
  jit_wait
  for dt in float32 bfloat16; do  # float32: tokens equal transformers'; bf16: flashinfer + the fused query pass
    stamp "DeepSeek-V3 real dims, $dt, N=$ngpu over NCCL"
    deepseek 150 9 --world-size "$ngpu" --interleave 4 --dtype $dt
  done
  if [ "$ngpu" -ge 2 ]; then
    stamp "prefill cost under CUDA graphs: gather KV vs split, 2 GPUs"
    timeout 120 python3 benchmarks/prefill_cost.py --graph --tokens 16 64 256 1024 4096 \
      --out "$OUT/prefill_cost_graph.json" 2>&1 | tail -34
    stamp "two-GPU NCCL test (fused kernel after a2a and ag_rs; background) + one-GPU tests"
    timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/test_backends_gpu.py -k two_gpus --timeout 290 \
      > "$OUT/two_gpus.log" 2>&1 &
    two=$!
  fi
  timeout 250 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/test_backends_gpu.py \
    -k "(nan or (fused-query and (mla or float16)) or mla-128x1) and $keep128" --timeout 100 2>&1 | grep -v "^SKIPPED" | tail -8
  if [ "$ngpu" -ge 2 ]; then
    wait "$two"
    grep "rank .: \|passed\|failed\|Error\|assert" "$OUT/two_gpus.log" | tail -14
    stamp "demo N=2, I=16, fused query pass (the default) over NCCL"
    timeout 90 python3 -m twostage_mla demo --world-size 2 --interleave 16 2>&1 | grep -v "USDT\|warn\|func(" | tail -12
  fi
elif [ "$part" = correct ]; then
  stamp "jit warm (background) + fused kernel launch-shape sweep on GPU 1"
  jit "mla bfloat16" "mla float16" "gqa bfloat16" "gqa float16"
  CUDA_VISIBLE_DEVICES=1 timeout 150 python3 benchmarks/query_merge_sweep.py --out "$OUT/query_merge_sweep.json"
  jit_wait

  stamp "two-GPU NCCL test (background) + one-GPU tests (both query paths, NaN caches, graphs)"
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/test_backends_gpu.py -k two_gpus --timeout 290 \
    > "$OUT/two_gpus.log" 2>&1 &
  two=$!
  timeout 280 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/test_backends_gpu.py \
    -k "$keep128" --timeout 200 2>&1 | grep -v "^SKIPPED" | tail -25
  stamp "Triton kernel tests on CUDA"
  kernel_tests
  wait "$two"
  stamp "two-GPU test result"
  grep "rank\|passed\|failed\|Error\|assert" "$OUT/two_gpus.log" | tail -16

  stamp check
  timeout 90 python3 -m twostage_mla check 2>&1 | grep -v "skipped" | tail -16
  stamp "demo: N=2 over NCCL, auto backend"
  for combine in a2a ag_rs; do
    timeout 90 python3 -m twostage_mla demo --world-size 2 --combine $combine --json > "$OUT/demo_$combine.json" \
      2> "$OUT/demo_$combine.err"
    echo "rc=$?"; head -c 600 "$OUT/demo_$combine.json"; echo; tail -3 "$OUT/demo_$combine.err"
  done
  stamp "torchrun example on 2 GPUs"
  timeout 90 torchrun --nproc-per-node 2 examples/torchrun_dcp_step.py --cuda 2>&1 | grep "rank\|Error" | tail -4
else
  stamp "jit warm (background) + fused kernel launch-shape sweep on the last GPU"
  # GQA too: the layer tests below otherwise build its modules inside their 120 s (killed at 30 of 63, session 53).
  jit "mla bfloat16" "mla float16" "gqa bfloat16" "gqa float16"
  # Q = 4 only: the whole grid (Q = 4 and 8) takes about 250 s, `kernel` runs it.
  CUDA_VISIBLE_DEVICES=$((ngpu - 1)) timeout 160 python3 benchmarks/query_merge_sweep.py --q-len 4 \
    --out "$OUT/query_merge_sweep.json"
  jit_wait
  stamp "a fresh process's first layer call, FlashInfer modules already built"
  timeout 60 python3 benchmarks/jit_warm.py mla bfloat16
  stamp "fused kernel on CUDA: kernel tests, layer tests against the oracle"
  kernel_tests
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/test_backends_gpu.py \
    -k "fused-query and (flashinfer or reference) and $keep128" --timeout 100 2>&1 | grep -v "^SKIPPED" | tail -8
  stamp "bench: B=32, the default (fused query pass) vs FlashInfer query pass + merge"
  timeout 200 python3 -m twostage_mla bench --batch 32 --context 1K,8K,32K --q-len 4,8 --heads 16,128 \
    --backends flashinfer --unfused --methods twostage,onepass,expand,floor --out "$OUT/bench_fused.json" 2>&1 | tail -40
  if [ "$ngpu" -lt 2 ]; then
    stamp "one GPU: DeepSeek-V3 real dims with N=1, check"
    deepseek 120 12 --world-size 1 --dtype bfloat16
    timeout 120 python3 -m twostage_mla check 2>&1 | grep -v skipped | tail -12
    stamp done; exit 0
  fi
  stamp "prefill cost: gather KV vs split, 2 GPUs"
  timeout 100 python3 benchmarks/prefill_cost.py --out "$OUT/prefill_cost.json" 2>&1 | tail -30
  stamp "over NCCL with the fused default: DeepSeek-V3 real dims, demo I=16, check (at once)"
  timeout 120 python3 examples/deepseek_v3_dcp.py --device cuda --world-size 2 --interleave 4 --real-dims \
    --dtype bfloat16 --max-new-tokens 12 > "$OUT/deepseek.log" 2>&1 &
  a=$!
  timeout 120 python3 -m twostage_mla demo --world-size 2 --interleave 16 > "$OUT/demo_i16.log" 2>&1 &
  b=$!
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m twostage_mla check > "$OUT/check.log" 2>&1 &
  c=$!
  wait "$a"; echo "deepseek rc=$?"; grep -v "Warning\|warn" "$OUT/deepseek.log" | tail -12
  wait "$b"; echo "demo rc=$?"; grep -v USDT "$OUT/demo_i16.log" | tail -12
  wait "$c"; echo "check rc=$?"; grep -v skipped "$OUT/check.log" | tail -12
fi
stamp done
