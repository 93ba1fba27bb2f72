"""One rank's attention work under DCP, split against expand, on one GPU (no collectives).

The bench (``twostage-mla bench``) runs one rank (N = 1), where the query pass
and the final merge cover every head. Under DCP with N ranks, each rank runs
the context pass over the N * H_loc gathered heads of its shard, but the
query pass and the final merge over its own H_loc heads only (design.md).
This probe times rank 0's share of one step at B requests of Q new tokens
and total context C (interleave 1), for two exact methods:

    twostage  FlashInfer's non-causal pass over local_len(C, 0) keys, N*H_loc heads;
              then the fused kernel: the N ranks' states (as the a2a delivers
              them) merged with the fresh keys, H_loc heads
    expand    each query as its own q_len = 1 request over local_len(C + j + 1, 0)
              keys (the new tokens already in the cache), N*H_loc heads; then the
              Triton merge of the N ranks' states, H_loc heads

The all-to-all between them moves the same bytes for both and is not timed.

    python benchmarks/dcp_rank_probe.py --out dcp_rank_probe.json
"""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import torch
from _args import require_at_least, require_cuda, require_writable

from twostage_mla.bench import _MLACall, time_many
from twostage_mla.kernels.merge import merge_states_triton
from twostage_mla.kernels.query_merge import query_merge_triton
from twostage_mla.layout import local_len


def _point(b: int, c: int, q: int, n: int, h_loc: int, ps: int, dev: torch.device) -> dict:
    dt, dv, d, h = torch.bfloat16, 512, 576, n * h_loc
    gen = torch.Generator(device=dev).manual_seed(0)
    t, scale = b * q, 1 / math.sqrt(d)
    lens = local_len(c + q, n, 1, 0)  # this rank's share of context and new tokens
    pages_per = -(-lens // ps)
    cache = torch.randn(b * pages_per, ps, 1, d, generator=gen, device=dev, dtype=dt)
    table = torch.randperm(b * pages_per, generator=gen, device=dev).to(torch.int32).view(b, pages_per)
    qx = torch.randn(t, h, d, generator=gen, device=dev, dtype=dt)
    kx = torch.randn(t, 1, d, generator=gen, device=dev, dtype=dt)
    qsl = torch.arange(b + 1, device=dev, dtype=torch.int32) * q
    ids = torch.arange(t, device=dev, dtype=torch.int32)
    plan = SimpleNamespace(num_tokens=t, token_request=ids // q, token_offset=ids % q, query_start_loc=qsl,
                           query_mask=None, max_q_len=q)
    states_o = torch.randn(n, t, h_loc, dv, generator=gen, device=dev, dtype=dt)  # as the a2a delivers them
    states_lse = torch.randn(n, t, h_loc, generator=gen, device=dev, dtype=torch.float32)

    ctx_lens = torch.full((b,), local_len(c, n, 1, 0), device=dev, dtype=torch.int32)
    context = _MLACall(qx, cache, qsl, ctx_lens, table, False, scale, dv)
    exp_lens = torch.tensor([local_len(c + int(i) + 1, n, 1, 0) for i in range(q)], device=dev).repeat(b)
    expand = _MLACall(qx, cache, torch.arange(t + 1, device=dev, dtype=torch.int32), exp_lens.to(torch.int32),
                      table.repeat_interleave(q, dim=0), False, scale, dv)
    qh, kv = qx[:, :h_loc], (kx, kx[..., :dv])
    fns = {
        "context": context,
        "fused": lambda: query_merge_triton(qh, *kv, plan, states_o, states_lse, scale=scale, out_dtype=dt),
        "expand": expand,
        "merge": lambda: merge_states_triton(states_o, states_lse, out_dtype=dt),
    }
    us = {k: v for k, (v, _) in time_many(fns).items()}
    two, exp = us["context"] + us["fused"], us["expand"] + us["merge"]
    return dict(B=b, C=c, Q=q, N=n, H_loc=h_loc, heads=h, local_context=int(ctx_lens[0]), **{f"{k}_us": v for k, v in
                us.items()}, twostage_us=two, expand_total_us=exp, expand_over_twostage=exp / two)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, nargs="+", default=[8192, 32768, 131072], help="total context C")
    p.add_argument("--q-len", type=int, nargs="+", default=[4, 8])
    p.add_argument("--world-size", type=int, nargs="+", default=[8])
    p.add_argument("--local-heads", type=int, nargs="+", default=[16], help="H_loc (the model's heads / TP)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--out", default="dcp_rank_probe.json")
    args = p.parse_args()
    require_at_least(p, args, 1, "batch", "context", "q_len", "world_size", "local_heads", "page_size")
    require_writable(p, args.out)
    require_cuda(p)
    dev = torch.device("cuda")
    rows = []
    print(f"{'N':>2} {'H_loc':>5} {'C':>7} {'Q':>2} | {'context':>8} {'fused':>6} {'twostage':>8} | "
          f"{'expand':>8} {'merge':>6} {'total':>8} | expand/twostage")
    for n in args.world_size:
        for h_loc in args.local_heads:
            for c in args.context:
                for q in args.q_len:
                    r = _point(args.batch, c, q, n, h_loc, args.page_size, dev)
                    rows.append(r)
                    print(f"{n:>2} {h_loc:>5} {c:>7} {q:>2} | {r['context_us']:>8.1f} {r['fused_us']:>6.1f} "
                          f"{r['twostage_us']:>8.1f} | {r['expand_us']:>8.1f} {r['merge_us']:>6.1f} "
                          f"{r['expand_total_us']:>8.1f} | {r['expand_over_twostage']:.3f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
