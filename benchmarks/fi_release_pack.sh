#!/usr/bin/env bash
# Pack another FlashInfer release for the GPU machine, which reaches no index and takes 64 MiB of files a
# call: its wheel (0.7.4: 101 MB, 715 MB unpacked) less what the flashinfer backend neither imports nor
# builds (the kernel sources of other families, data/csrc/*/, and the subpackages `import flashinfer`
# leaves alone), as .whl/flashinfer-VERSION.tar.xz (0.7.4: 16 MB). Its other wheels are those of
# ../shared/device/wheels.sh, in .whl already. Then, there: bash benchmarks/gpu_verify.sh release VERSION
#   bash benchmarks/fi_release_pack.sh 0.7.4
set -euo pipefail
ver=${1:?usage: fi_release_pack.sh VERSION}
root=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "flashinfer-python==$ver"
mkdir "$tmp/site"
(cd "$tmp/site" && python3 -m zipfile -e "$tmp"/flashinfer_python-*.whl . && rm -rf ./*.dist-info build_*.py b12x)
# What `import flashinfer` needs here to list its subpackages (the GPU machine has the rest).
python3 -m pip install -q --no-deps --target "$tmp/deps" "apache-tvm-ffi<0.2" nvidia-ml-py click tabulate \
  "nvidia-cudnn-frontend>=1.32" packaging
find "$tmp/site/flashinfer/data/csrc" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
PYTHONPATH="$tmp/deps:$tmp/site" python3 - "$tmp/site/flashinfer" <<'EOF'
import os, shutil, sys
import flashinfer, flashinfer.mla, flashinfer.prefill, flashinfer.utils  # noqa: E401, F401
root = sys.argv[1]
used = {m.split(".")[1] for m in sys.modules if m.startswith("flashinfer.")}
for d in sorted(os.listdir(root)):
    if os.path.isdir(os.path.join(root, d)) and d not in used | {"data", "__pycache__"}:
        shutil.rmtree(os.path.join(root, d))
print("flashinfer", flashinfer.__version__, "kept", len(used), "subpackages")
EOF
find "$tmp/site" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p "$root/.whl"
tar -C "$tmp/site" -cf - flashinfer | xz -9 -T0 > "$root/.whl/flashinfer-$ver.tar.xz"
ls -la "$root/.whl/flashinfer-$ver.tar.xz"
