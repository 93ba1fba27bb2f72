#!/usr/bin/env bash
# Why did later processes rebuild FlashInfer JIT modules that benchmarks/jit_warm.py had just built?
#   MODE=one|ser|par bash benchmarks/jit_probe.sh   # one warm-up (GQA bf16, head dim 64) run twice, or the
#                                                   # head dims 64, 128 and 256 in turn, or all at once
# Then the tests that rebuilt the modules on the H100 (session 46). After each step: ninja's own account of
# what it would rebuild, per module, and checksums of the generated sources and build files. Set
# FLASHINFER_WORKSPACE_BASE to start from an empty JIT cache (FI=VERSION as in gpu_verify.sh). Logs land in
# $OUT. For FlashInfer 0.5.3 and 0.6.0, which run every module's ninja from cached_ops (0.6.9 runs it from
# each module's directory).
# Session 47 (H100, FlashInfer 0.5.3): `par` left ninja's shared deps log short ("premature end of file")
# and the tests rebuilt all three modules (55 - 64 s each); `one` and `ser` left nothing to rebuild.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/jit_probe.log") 2>&1
ver=${FI:-}
source benchmarks/_fi_site.sh
export MAX_JOBS=16 PYTHONUNBUFFERED=1
C=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_JIT_DIR)")
G=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_GEN_SRC_DIR)")
echo "jit dir $C; generated $G; ninja $(command -v ninja) $(ninja --version 2>&1)"
snap() {  # $1: a tag; checksums of what decides a rebuild, and the .so files' times
  (cd "$C/.." && find . -type f \( -name "*.so" -o -name build.ninja -o -name "*.cu" -o -name "*.h" -o -name "*.cuh" -o -name "*.inc" \) \
    -newer /tmp/t0 -printf "%TT %s %p\n" | sort) > "$OUT/snap_$1.txt"
  (cd "$C/.." && find . -type f \( -name build.ninja -o -path "*generated*" \) -exec md5sum {} + | sort -k2) > "$OUT/md5_$1.txt"
  for d in "$C"/*/; do
    [ -f "$d/build.ninja" ] || continue
    echo "--- $(basename "$d")"; (cd "$C" && ninja -n -d explain -f "$d/build.ninja" 2>&1 | head -12)
  done > "$OUT/explain_$1.txt"
  echo "[$1] $(wc -l < "$OUT/snap_$1.txt") files newer than start; would rebuild: $(grep -c "^ninja explain" "$OUT/explain_$1.txt"); deps log read short: $(grep -c "premature end" "$OUT/explain_$1.txt")"
}
touch /tmp/t0
dims="64 128 256"
k="gqa-1x1-d64 or gqa-4x4-d128 or gqa-16x1-d256"  # the tests at those dims that rebuilt in session 46
case "${MODE:-one}" in
  par)  # as `gpu_verify.sh heads gqa` warmed up until session 47: three head dims at once
    pids=(); for d in $dims; do python3 benchmarks/jit_warm.py gqa bfloat16 --head-dim $d & pids+=($!); done
    wait "${pids[@]}" ;;  # not a bare wait: that also waits for the tee above
  ser) for d in $dims; do python3 benchmarks/jit_warm.py gqa bfloat16 --head-dim $d; done ;;
  one) k="gqa-1x1-d64"; python3 benchmarks/jit_warm.py gqa bfloat16 --head-dim 64; snap warm0
    /usr/bin/time -f "second warm-up: %e s" python3 benchmarks/jit_warm.py gqa bfloat16 --head-dim 64 ;;
esac
snap warm
/usr/bin/time -f "test: %e s" python3 -m pytest -q -p no:cacheprovider tests/test_backends_gpu.py --durations=3 \
  -k "head_counts and ($k) and flashinfer and backend-query and chain" 2>&1 | tail -6
snap test
diff "$OUT/md5_warm.txt" "$OUT/md5_test.txt" | head -20
diff "$OUT/snap_warm.txt" "$OUT/snap_test.txt" | head -20
for f in "$C"/*/build.ninja; do cp "$f" "$OUT/$(basename "$(dirname "$f")" | cut -c 1-60).ninja"; done
