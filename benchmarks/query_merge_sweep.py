"""Launch-shape sweep of the fused query+merge kernel (kernels/query_merge.py) on one GPU.

For MLA (576/512, one latent KV head) at B requests of Q tokens, times the
kernel alone, under a CUDA graph (twostage_mla.bench.time_many), for every
launch shape (heads and warps per program, head-dim and value-dim chunks,
value chunks in flight; shapes past the GPU's shared memory are listed, not
timed), merging with K context states (K = 1: N = 1 or
ag_rs; K = 2: a2a with N = 2). Prints the best per shape.

    python benchmarks/query_merge_sweep.py --out sweep.json
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
from types import SimpleNamespace

import torch
from _args import require_at_least, require_cuda, require_powers_of_two, require_writable
from triton.runtime.errors import OutOfResources

from twostage_mla.bench import time_many
from twostage_mla.kernels.query_merge import query_merge_triton


def _inputs(b: int, q: int, h: int, k_states: int, dev: torch.device) -> tuple:
    t = b * q
    gen = torch.Generator(device=dev).manual_seed(0)
    qx = torch.randn(t, h, 576, device=dev, dtype=torch.bfloat16, generator=gen)
    kx = torch.randn(t, 1, 576, device=dev, dtype=torch.bfloat16, generator=gen)
    ctx_o = torch.randn(k_states, t, h, 512, device=dev, dtype=torch.bfloat16, generator=gen)
    ctx_lse = torch.randn(k_states, t, h, device=dev, dtype=torch.float32, generator=gen)
    ids = torch.arange(t, device=dev, dtype=torch.int32)
    plan = SimpleNamespace(  # the plan fields the kernel reads
        num_tokens=t,
        token_request=ids // q,
        token_offset=ids % q,
        query_start_loc=torch.arange(0, t + 1, q, device=dev, dtype=torch.int32),
        query_mask=None,
        max_q_len=q,
    )
    return qx, kx, kx[..., :512], plan, ctx_o, ctx_lse


def _launches(args: argparse.Namespace, heads: int) -> list[dict]:
    """Every launch shape of the grid that fits the heads (no block of heads past max(16, heads))."""
    grid = itertools.product(args.block_h, args.warps, args.block_d, args.block_v, args.v_stages)
    return [
        dict(block_h=bh, num_warps=w, block_d=bd, block_v=bv, v_stages=vs)
        for bh, w, bd, bv, vs in grid
        if bh <= max(16, heads)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--q-len", type=int, nargs="+", default=[4, 8])
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--states", type=int, nargs="+", default=[1, 2])
    p.add_argument("--block-h", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[4])
    p.add_argument("--block-d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--block-v", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--v-stages", type=int, nargs="+", default=[2, 3])
    p.add_argument("--prev", default=None, help="a module path holding an earlier query_merge_triton to time too")
    p.add_argument("--out", default="query_merge_sweep.json")
    args = p.parse_args()
    require_at_least(p, args, 1, "batch", "q_len", "heads", "v_stages")
    require_at_least(p, args, 0, "states")
    require_powers_of_two(p, args, 16, "block_h", "block_d", "block_v")
    require_powers_of_two(p, args, 1, "warps")
    if args.prev and not os.path.isfile(args.prev):
        p.error(f"expected --prev to be a Python file holding query_merge_triton, got {args.prev!r}")
    require_writable(p, args.out)
    require_cuda(p)
    dev = torch.device("cuda")
    prev = None
    if args.prev:
        spec = importlib.util.spec_from_file_location("prev_kernel", args.prev)
        prev = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(prev)
    rows, skipped = [], []
    for q, h, k in itertools.product(args.q_len, args.heads, args.states):
        x = _inputs(args.batch, q, h, k, dev)
        ref = query_merge_triton(*x, scale=0.1, out_dtype=torch.bfloat16)
        fns, too_big = {}, []
        for kw in _launches(args, h):
            name = ",".join(map(str, kw.values()))
            try:
                o, lse = query_merge_triton(*x, scale=0.1, out_dtype=torch.bfloat16, **kw)
            except OutOfResources:  # more shared memory than this GPU has: the library refuses it too
                too_big.append(name)
                continue
            # Every launch shape must give the default's answer (fp32 sums in another order: tiny drift).
            assert torch.allclose(o.float(), ref[0].float(), atol=2e-2) and torch.allclose(lse, ref[1], atol=1e-4)
            fns[name] = lambda x=x, kw=kw: query_merge_triton(*x, scale=0.1, out_dtype=torch.bfloat16, **kw)
        fns["default"] = lambda x=x: query_merge_triton(*x, scale=0.1, out_dtype=torch.bfloat16)
        # The default launch reading a causal mask, as under capture limits with max_q_len <= 16.
        causal = torch.ones(q, q, dtype=torch.bool, device=dev).tril().expand(args.batch, q, q).contiguous()
        xm = (*x[:3], SimpleNamespace(**{**vars(x[3]), "query_mask": causal}), *x[4:])
        o, lse = query_merge_triton(*xm, scale=0.1, out_dtype=torch.bfloat16)
        assert torch.allclose(o.float(), ref[0].float(), atol=2e-2) and torch.allclose(lse, ref[1], atol=1e-4)
        fns["default+mask"] = lambda xm=xm: query_merge_triton(*xm, scale=0.1, out_dtype=torch.bfloat16)
        if prev is not None:
            o, lse = prev.query_merge_triton(*x, scale=0.1, out_dtype=torch.bfloat16)
            assert torch.allclose(o.float(), ref[0].float(), atol=2e-2) and torch.allclose(lse, ref[1], atol=1e-4)
            fns["prev"] = lambda x=x: prev.query_merge_triton(*x, scale=0.1, out_dtype=torch.bfloat16)
        for name, (us, _) in time_many(fns, budget_s=0.2).items():
            keys = ("block_h", "num_warps", "block_d", "block_v", "v_stages")
            shape = dict(zip(keys, map(int, name.split(",")))) if "," in name else {}
            rows.append(dict(B=args.batch, Q=q, heads=h, states=k, launch=name, **shape, time_us=us))
        mine = [r for r in rows if (r["Q"], r["heads"], r["states"]) == (q, h, k)]
        best = sorted(mine, key=lambda r: r["time_us"])
        named = {r["launch"]: r["time_us"] for r in mine}
        print(
            f"Q={q} heads={h} states={k}: default {named['default']:.1f} us"
            + f", with a causal mask {named['default+mask']:.1f}"
            + (f", prev {named['prev']:.1f}" if "prev" in named else "")
            + "; best "
            + ", ".join(f"({r['launch']}) {r['time_us']:.1f}" for r in best[:4])
            + (f"; {len(too_big)} past shared memory: " + " ".join(f"({n})" for n in too_big) if too_big else ""),
            flush=True,
        )
        skipped += [dict(B=args.batch, Q=q, heads=h, states=k, launch=n) for n in too_big]
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows, past_shared_memory=skipped), f, indent=1)


if __name__ == "__main__":
    main()
