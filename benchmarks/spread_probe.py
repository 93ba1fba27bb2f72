"""The layer against onepass where the requests' contexts differ, at B = 32 on one GPU.

    python3 benchmarks/spread_probe.py --out spread_probe.json

The bench gives every request the same context C, a power of two: FlashInfer's MLA
kernel then reads C + Q keys in onepass and C in the split's context pass, and crossing
a page boundary costs it more than the page's bytes (bench C = 8192 against 8000). This
probe draws each request's context uniformly from [C/2, 3C/2) as a server's batch has
them ("random"), next to all equal to C ("equal"), and times, interleaved under CUDA
graphs (bench.time_many):
  split    the layer, context_pass "split" (non-causal pass + fused query merge);
  expand   the layer, context_pass "expand" (one request per token, no merge), where
           it reads the cache once (Q = 1) or the kernel is compute-bound (heads >= 64);
  onepass  one causal FlashInfer MLA call over C + Q keys.
It decides FlashInfer's "auto" rule at Q = 1 (backends/flashinfer.py).
"""

from __future__ import annotations

import argparse

import torch
from _args import require_at_least, require_cuda, require_writable

from twostage_mla import AttentionConfig, DCPLayout, TwoStageAttention
from twostage_mla.bench import _dump, _MLACall, _twostage_fns, time_many


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--q-len", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out", default="spread_probe.json")
    a = p.parse_args()
    require_at_least(p, a, 1, "batch", "heads", "q_len")
    require_at_least(p, a, 2, "context")
    require_writable(p, a.out)
    require_cuda(p)
    dev, dt, ps, dv, d = torch.device("cuda", 0), torch.bfloat16, 64, 512, 576
    scale, b = d**-0.5, a.batch
    recs: list[dict] = []
    print(f"{torch.cuda.get_device_name(0)}, B = {b}: us (ratio to onepass)", flush=True)
    for c in a.context:
        for spread in ("equal", "random"):
            gen = torch.Generator(device=dev).manual_seed(c)
            draw = torch.randint(c // 2, c + c // 2, (b,), generator=torch.Generator().manual_seed(c))
            ctx = torch.full((b,), c) if spread == "equal" else draw
            pages = -(-(int(ctx.max()) + max(a.q_len)) // ps)
            cache = torch.randn(b * pages, ps, 1, d, generator=gen, device=dev, dtype=dt)
            table = torch.randperm(b * pages, generator=gen, device=dev).view(b, pages).to(torch.int32)
            for h in a.heads:
                cfg = AttentionConfig.mla(num_heads=h, kv_lora_rank=dv, rope_dim=d - dv, page_size=ps, scale=scale)
                for q in a.q_len:
                    qx = torch.randn(b * q, h, d, generator=gen, device=dev, dtype=dt)
                    kx = torch.randn(b * q, 1, d, generator=gen, device=dev, dtype=dt)
                    qsl = torch.arange(b + 1, device=dev, dtype=torch.int32) * q
                    seq = (ctx + q).to(dev, torch.int32)
                    fns = {}
                    for cpass in ("split", "expand") if q == 1 or h >= 64 else ("split",):
                        attn = TwoStageAttention(cfg, DCPLayout(), backend="flashinfer", dtype=dt, device=dev,
                                                 context_pass=cpass)  # fmt: skip
                        plan = attn.plan(qsl, seq, table)
                        fns[cpass] = _twostage_fns(cpass, attn, plan, qx, kx, cache)[f"{cpass}:full"]
                    outs = {k: fn().float() for k, fn in fns.items()}
                    fns["onepass"] = _MLACall(qx, cache, qsl, seq, table, True, scale, dv)
                    ref = fns["onepass"]().float()
                    diff = {k: (o - ref).abs().max().item() for k, o in outs.items()}
                    res = time_many(fns)
                    one = res["onepass"][0]
                    for k, (us, g) in res.items():
                        recs.append({"method": k, "spread": spread, "B": b, "C": c, "Q": q, "heads": h,
                                     "time_us": us, "graph": g, "ratio_to_onepass": us / one,
                                     "max_abs_diff_to_onepass": diff.get(k), "contexts": ctx.tolist(),
                                     "gpu": torch.cuda.get_device_name(0)})  # fmt: skip
                    line = "  ".join(f"{k} {us:8.1f} ({us / one:.3f})" for k, (us, _) in res.items())
                    print(f"C={c:>6} {spread:>6} H={h:>3} Q={q}: {line}  max |diff| {max(diff.values()):.3g}",
                          flush=True)  # fmt: skip
                    del fns
            del cache
            torch.cuda.empty_cache()
            _dump(recs, a.out)


if __name__ == "__main__":
    main()
