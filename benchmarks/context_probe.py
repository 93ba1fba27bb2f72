"""Probe the non-causal context pass (FlashInfer MLA) at B = 32, on one GPU.

    python3 benchmarks/context_probe.py --out results/context_probe.json

For each (heads, C, Q) it times, interleaved (bench.time_many, CUDA graphs):
  rows   the layer's call: Q query rows per request, H heads;
  folded the same pass with each request's Q queries folded into the heads:
         one row per request, Q*H heads (exact only because nothing is causal);
and checks the two agree. At the issue's target point (16 heads, C = 32K,
Q = 4) it also times the layer's call back to back with nothing between
(eager, 30 runs: the way the device README's 288.5 us was read), to see
what the L2 left by the previous run is worth.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _args import require_at_least, require_cuda, require_writable

from twostage_mla.bench import _dump, _events_us, _MLACall, copy_bandwidth_gbs, time_many


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--q-len", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--out", default="context_probe.json")
    a = p.parse_args()
    require_at_least(p, a, 1, "batch", "heads", "context", "q_len")
    require_writable(p, a.out)
    require_cuda(p)
    dev, dt, ps, dv, d = torch.device("cuda", 0), torch.bfloat16, 64, 512, 576
    scale = 192**-0.5
    bw = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name(0)}: copy {bw:.0f} GB/s", flush=True)
    recs: list[dict] = [{"what": "copy", "gbps": bw}]
    b = a.batch
    for c in a.context:
        gen = torch.Generator(device=dev).manual_seed(0)
        pages = -(-c // ps)
        cache = torch.randn(b * pages, ps, 1, d, generator=gen, device=dev, dtype=dt)
        table = torch.randperm(b * pages, generator=gen, device=dev).view(b, pages).to(torch.int32)
        lens = torch.full((b,), c, device=dev, dtype=torch.int32)
        kv_bytes = b * c * d * 2
        for h in a.heads:
            for q in a.q_len:
                qx = torch.randn(b * q, h, d, generator=gen, device=dev, dtype=dt)
                rows = _MLACall(
                    qx, cache, torch.arange(b + 1, device=dev, dtype=torch.int32) * q, lens, table, False, scale, dv
                )
                fns = {"rows": rows}
                try:
                    folded = _MLACall(
                        qx.view(b, q * h, d),
                        cache,
                        torch.arange(b + 1, device=dev, dtype=torch.int32),
                        lens,
                        table,
                        False,
                        scale,
                        dv,
                    )
                    o1, o2 = rows(), folded().view(b * q, h, dv)
                    err = (o1.float() - o2.float()).abs().max().item()
                    fns["folded"] = folded
                except Exception as e:  # noqa: BLE001 - a probe: record why and go on
                    err = f"{type(e).__name__}: {e}"[:300]
                res = time_many(fns)
                for k, (us, g) in res.items():
                    recs.append(
                        {
                            "what": k,
                            "B": b,
                            "C": c,
                            "Q": q,
                            "heads": h,
                            "time_us": us,
                            "graph": g,
                            "gbps": kv_bytes / (us * 1e-6) / 1e9,
                            "fold_max_abs_diff": err,
                        }
                    )
                line = " ".join(
                    f"{k} {us:8.1f} us ({kv_bytes / (us * 1e-6) / 1e9 / bw:5.1%})" for k, (us, _) in res.items()
                )
                print(f"C={c:>6} H={h:>3} Q={q}: {line}  fold diff {err}", flush=True)
                if (h, c, q) == (16, 32768, 4):
                    for name, fn in fns.items():
                        for _ in range(3):
                            fn()
                        torch.cuda.synchronize()
                        us = statistics.median(_events_us(fn, 30))
                        recs.append(
                            {
                                "what": f"{name}_back_to_back_eager",
                                "B": b,
                                "C": c,
                                "Q": q,
                                "heads": h,
                                "time_us": us,
                                "gbps": kv_bytes / (us * 1e-6) / 1e9,
                            }
                        )
                        print(
                            f"  {name} back to back, eager: {us:.1f} us ({kv_bytes / (us * 1e-6) / 1e9 / bw:.1%})",
                            flush=True,
                        )
                del fns, rows
        del cache
        torch.cuda.empty_cache()
        _dump(recs, a.out)


if __name__ == "__main__":
    main()
