"""Launch-shape sweep of the fused query+merge kernel (kernels/query_merge.py) on one GPU.

For MLA (576/512, one latent KV head) at B requests of Q tokens, times the
kernel alone, under a CUDA graph (twostage_mla.bench.time_many), for every
(heads, warps) per program, merging with K context states
(K = 1: N = 1 or ag_rs; K = 2: a2a with N = 2). Prints the best per shape.

    python benchmarks/query_merge_sweep.py --out sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from types import SimpleNamespace

import torch

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
    plan = SimpleNamespace(  # the four plan fields the kernel reads
        token_request=ids // q,
        token_offset=ids % q,
        query_start_loc=torch.arange(0, t + 1, q, device=dev, dtype=torch.int32),
        query_mask=None,
    )
    return qx, kx, kx[..., :512], plan, ctx_o, ctx_lse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--q-len", type=int, nargs="+", default=[4, 8])
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--states", type=int, nargs="+", default=[1, 2])
    p.add_argument("--block-h", type=int, nargs="+", default=[16, 32])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--out", default="query_merge_sweep.json")
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    for q, h, k in itertools.product(args.q_len, args.heads, args.states):
        x = _inputs(args.batch, q, h, k, dev)
        ref = query_merge_triton(*x, scale=0.1, out_dtype=torch.bfloat16)
        fns = {}
        for bh, w in itertools.product(args.block_h, args.warps):
            kw = dict(scale=0.1, out_dtype=torch.bfloat16, block_h=bh, num_warps=w)
            o, lse = query_merge_triton(*x, **kw)
            # Every launch shape must give the default's answer (fp32 sums in another order: tiny drift).
            assert torch.allclose(o.float(), ref[0].float(), atol=2e-2) and torch.allclose(lse, ref[1], atol=1e-4)
            fns[f"{bh},{w}"] = lambda x=x, kw=kw: query_merge_triton(*x, **kw)
        fns["default"] = lambda x=x: query_merge_triton(*x, scale=0.1, out_dtype=torch.bfloat16)
        for name, (us, _) in time_many(fns, budget_s=0.2).items():
            shape = dict(zip(("block_h", "num_warps"), map(int, name.split(",")))) if "," in name else {}
            rows.append(dict(B=args.batch, Q=q, heads=h, states=k, launch=name, **shape, time_us=us))
        mine = [r for r in rows if (r["Q"], r["heads"], r["states"]) == (q, h, k)]
        best = sorted(mine, key=lambda r: r["time_us"])
        default = next(r for r in mine if r["launch"] == "default")
        print(
            f"Q={q} heads={h} states={k}: default {default['time_us']:.1f} us; best "
            + ", ".join(f"({r['launch']}) {r['time_us']:.1f}" for r in best[:4]),
            flush=True,
        )
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
