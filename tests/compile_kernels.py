"""Compile the library's Triton kernels for an H100/H200 (sm_90) on a machine without a GPU.

Triton's CPU interpreter runs the kernels' maths in CI, but it does not check
them the way the GPU compiler does: a kernel once passed every interpreter test
and failed to compile on the H200 (a loop-carried index changed type). This
compiles each variant the launchers pick, through ptxas, and prints one line
per variant with its shared memory. Run without TRITON_INTERPRET (the test
does so in a subprocess):

    python tests/compile_kernels.py
"""

from __future__ import annotations

import itertools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from twostage_mla.kernels import merge, query_merge

TARGET = GPUTarget("cuda", 90, 32)
# Pointer arguments by name, per kernel (bf16 activations, float32 lse, int64 token indices); every
# other argument is a 32-bit int, as the launchers pass them.
QUERY_MERGE = {
    "Q": "*bf16", "K": "*bf16", "V": "*bf16", "REQ": "*i64", "OFF": "*i64", "QSL": "*i32", "MASK": "*i1",
    "CO": "*bf16", "CLSE": "*fp32", "OUT": "*bf16", "OUT_LSE": "*fp32", "scale": "fp32",
}  # fmt: skip
MERGE = {"O_IN": "*bf16", "LSE": "*fp32", "EO": "*bf16", "ELSE": "*fp32", "OUT": "*bf16", "OUT_LSE": "*fp32"}


def compile_one(fn, pointers: dict, constexprs: dict, num_stages: int = 3) -> int:
    """Compile fn with these constexprs for TARGET; returns its shared memory in bytes."""
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs=constexprs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=4, num_stages=num_stages)).metadata.shared


def main() -> None:
    # The fused query+merge kernel: the default launch shapes below and from 64 heads per KV head
    # (value chunks in flight: 2; from 64 heads 3 with one context state), with and without a mask,
    # short and long requests; then the no-pipelining fallback.
    shapes = {
        "16 heads": (dict(query_merge._NARROW_LAUNCH, BLOCK_V=512), (2,)),  # MLA's 512 value dims whole
        "128 heads": (query_merge._WIDE_LAUNCH, (3, 2)),
    }
    # 64-bit offsets (WIDE, steps with a tensor of >= 2^31 elements): the default stages, no mask.
    combos = itertools.product(shapes.items(), [False, True], [False, True], [False, True])
    for (name, (shape, in_flight)), mask, long, wide in combos:
        stages = [(v, 4) for v in in_flight] + ([(1, 1)] if not (mask or long or wide) else [])
        for v_stages, num_stages in stages[:1] if wide else stages:
            if wide and mask:
                continue
            cons = dict(HAS_MASK=mask, PRECISION="tf32", DOT_F32=False, BLOCK_N=16, LONG=long, V_STAGES=v_stages,
                        WIDE=wide, **shape)  # fmt: skip
            shared = compile_one(query_merge._query_merge_kernel, QUERY_MERGE, cons, num_stages)
            print(f"query_merge {name} mask={mask} long={long} wide={wide} stages={v_stages},{num_stages}: {shared} B")
    for extra, wide in itertools.product((False, True), (False, True)):
        shared = compile_one(merge._merge_kernel, MERGE, dict(HAS_EXTRA=extra, BLOCK_D=512, WIDE=wide))
        print(f"merge extra={extra} wide={wide}: {shared} B")


if __name__ == "__main__":
    main()
