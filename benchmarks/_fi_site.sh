# Sourced by gpu_verify.sh and jit_probe.sh: puts FlashInfer on PYTHONPATH, the 0.5.3 wheel from .whl, or
# with $ver set another release (from benchmarks/fi_release_pack.sh) with its own JIT cache.
site=/tmp/site
wheels=(.whl/*.whl)
if [ -n "${ver:-}" ]; then
  site=/tmp/site-$ver
  wheels=($(ls .whl/*.whl | grep -v flashinfer_python))
  export FLASHINFER_WORKSPACE_BASE=/tmp/fi-$ver
fi
# Once per machine: installing again renews the headers' times, and ninja then rebuilds every FlashInfer
# module the calls before had built (pip keeps no file times; session 47).
if [ "$(cat "$site/.installed" 2>/dev/null)" != "${ver:-} ${wheels[*]}" ]; then
  [ -n "${ver:-}" ] && mkdir -p "$site" && tar -C "$site" -xJf ".whl/flashinfer-$ver.tar.xz"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" \
    && echo "${ver:-} ${wheels[*]}" > "$site/.installed"
else
  echo "FlashInfer site $site: installed earlier on this machine, kept"
fi
export PYTHONPATH=$site:$PWD
