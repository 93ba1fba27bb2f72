#!/usr/bin/env bash
# Session 58: DeepSeek-V3 real dims in bfloat16 with the kernel of session 57, of 412a93f, and unfused.
set -u
OUT=${OUT:-/tmp/o}; mkdir -p "$OUT"
OUT=$OUT bash benchmarks/gpu_verify.sh model
exec > >(tee -a "$OUT/probe.log") 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader
echo "=== kernel probe (default / narrow / wide vs float64)"
timeout 120 python3 benchmarks/narrow_launch_probe.py
rm -rf /tmp/prev /tmp/nofuse; mkdir -p /tmp/prev /tmp/nofuse
cp -r twostage_mla /tmp/prev/; cp benchmarks/_query_merge_prev.py /tmp/prev/twostage_mla/kernels/query_merge.py
cp -r twostage_mla /tmp/nofuse/; sed -i 's/fuse_query in (None, True) else None/fuse_query is True else None/' /tmp/nofuse/twostage_mla/layer.py
grep -c "fuse_query is True" /tmp/nofuse/twostage_mla/layer.py
ds() { timeout 150 python3 examples/deepseek_v3_dcp.py --device cuda --world-size 1 --real-dims --dtype bfloat16 \
  --max-new-tokens 12 "$@" 2>&1 | grep -v "Warning\|warn" | tail -9; }
for tree in new prev nofuse; do
  src=$PWD; [ $tree != new ] && src=/tmp/$tree
  echo "=== DeepSeek-V3 bf16 I=4, twostage_mla from $src"
  # from /tmp: in the repository root the checkout would come first on sys.path and hide $src
  (cd /tmp && PYTHONPATH=/tmp/site:$src python3 -c "import twostage_mla.kernels.query_merge as m; print(m.__file__)")
  PYTHONPATH=/tmp/site:$src ds --interleave 4
done
echo "=== new kernel, I=1 (session 54's setting)"; ds --interleave 1
echo "=== new kernel, I=4, tree"; ds --interleave 4 --tree
