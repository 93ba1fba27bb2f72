"""Probe: could FlexAttention serve the MLA context pass faster than torch_efficient?

Issue 3 asks for a stock MLA path that needs no extra package (FlexAttention, or
torch's memory-efficient kernel). The library ships torch_efficient; this times
torch.compile'd flex_attention on the same context pass (B requests, Q queries
each, non-causal over each request's C cached keys, MLA 576/512, bf16), in its
best case: the keys already contiguous per request (no page gather, which
torch_efficient pays). Next to it, in the same process: torch_efficient's and,
where installed, flashinfer's context pass through the layer's backends.

    python benchmarks/flex_probe.py --out flex_probe.json          # on a GPU
    python benchmarks/flex_probe.py --smoke                        # tiny, CPU, eager
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _args import require_cuda, require_writable
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from twostage_mla import AttentionConfig, DCPLayout, TwoStageAttention
from twostage_mla.backends import refusals
from twostage_mla.bench import _events_us


def _time_us(fn, reps: int) -> float:
    """Median of reps CUDA-event timings of fn(), after two warm-up calls."""
    for _ in range(2):
        fn()
    return statistics.median(_events_us(fn, reps))


def probe(b: int, c: int, q_len: int, heads: int, dev: torch.device, reps: int, options: dict) -> dict:
    dv, d, ps = 512, 576, 64
    scale = 192**-0.5
    t, s = b * q_len, b * c
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(t, heads, d, device=dev, generator=g).bfloat16()
    k_flat = torch.randn(s, d, device=dev, generator=g).bfloat16()  # request r's keys: rows r*C .. (r+1)*C-1
    k_cache = k_flat.view(s // ps, ps, 1, d)  # the same keys as pages in order
    qsl = torch.arange(0, t + 1, q_len, dtype=torch.int32, device=dev)
    seq_lens = torch.full((b,), c + q_len, dtype=torch.int32, device=dev)
    width = -(-(c + q_len) // ps)
    table = torch.arange(b * width, dtype=torch.int32, device=dev).view(b, width) % (s // ps)
    for r in range(b):  # request r's context pages r*C/ps .., the last (new tokens') page anywhere valid
        table[r, : c // ps] = torch.arange(r * c // ps, (r + 1) * c // ps, dtype=torch.int32, device=dev)

    q_doc = torch.arange(t, device=dev) // q_len

    def same_request(b_, h_, q_idx, kv_idx):
        return q_doc[q_idx] == kv_idx // c

    mask = create_block_mask(same_request, None, None, t, s, device=str(dev))
    fa = torch.compile(flex_attention, dynamic=False) if dev.type == "cuda" else flex_attention
    qf, kf, vf = q.transpose(0, 1)[None], k_flat[None, None], k_flat[None, None, :, :dv].contiguous()

    def flex():
        return fa(qf, kf, vf, block_mask=mask, scale=scale, enable_gqa=True, return_lse=True, kernel_options=options)

    t0 = time.time()
    o_flex, lse_flex = flex()
    compile_s = time.time() - t0
    o_flex = o_flex[0].transpose(0, 1)  # (T, H, Dv)
    rec = dict(B=b, C=c, Q=q_len, heads=heads, gpu=torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
               torch=torch.__version__, flex_first_call_s=round(compile_s, 1), kernel_options=options)  # fmt: skip
    cfg = AttentionConfig.mla(num_heads=heads, kv_lora_rank=dv, rope_dim=d - dv, page_size=ps, scale=scale)
    spec = TwoStageAttention(cfg, DCPLayout(), backend="reference", dtype=torch.bfloat16, device=dev).spec
    names = ["reference"] if dev.type == "cpu" else ["torch_efficient"]
    names += [] if dev.type == "cpu" or refusals(spec)["flashinfer"] else ["flashinfer"]
    ref = None
    for name in names:
        attn = TwoStageAttention(cfg, DCPLayout(), backend=name, dtype=torch.bfloat16, device=dev)
        plan = attn.plan(qsl, seq_lens, table)

        def context(attn=attn, plan=plan):
            return attn.backend.context(q, k_cache, k_cache[..., :dv], plan)

        ref = context()[0] if ref is None else ref
        if dev.type == "cuda":
            rec[f"{name}_us"] = _time_us(context, reps)
    rec["flex_max_abs_diff"] = (o_flex.float() - ref.float()).abs().max().item()
    if dev.type == "cuda":
        rec["flex_us"] = _time_us(flex, reps)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, eager flex (a correctness check)")
    ap.add_argument("--out", default=None, help="JSON records")
    a = ap.parse_args()
    require_writable(ap, a.out)
    if not a.smoke:
        require_cuda(ap, "times flex_attention on one; --smoke runs tiny shapes on the CPU")
    if a.smoke:
        points, dev, reps = [(2, 128, 3, 2)], torch.device("cpu"), 1
    else:
        points, dev, reps = [(32, 8192, 4, 16), (32, 32768, 4, 16), (32, 8192, 4, 128)], torch.device("cuda"), 20
    # At D = 576 the default tiles need 426 KB of shared memory (the H200 has 227 KB): smaller ones.
    tiles = [None, dict(BLOCK_M=32, BLOCK_N=32, num_stages=1, num_warps=4), dict(BLOCK_M=16, BLOCK_N=16, num_stages=1)]
    records = []
    for p in points:
        for options in tiles[:1] if a.smoke else tiles[1:]:
            try:
                records.append(probe(*p, dev, reps, options))
            except Exception as e:  # a shape or tile flex cannot compile: say so and go on
                err = f"{type(e).__name__}: {e}"[:300]
                records.append(dict(B=p[0], C=p[1], Q=p[2], heads=p[3], kernel_options=options, error=err))
            print(json.dumps(records[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
