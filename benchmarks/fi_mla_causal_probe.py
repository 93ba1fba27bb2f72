"""Where FlashInfer's causal MLA kernel is exact: heads x q_len x context against a float32 reference.

    python3 benchmarks/fi_mla_causal_probe.py --out fi_mla_causal.json

FlashInfer 0.5.3's sm90 MLA kernel starts a tile of packed rows (query x head)
at key tile ceil(min(kv_end, kv_len - q_len + (start + tile) // heads) / 64) - 1.
The scheduler's bound is a ceiling, this one a floor: where heads does not
divide start + tile (tiles of 64 or 128 rows), it is one key short of the
tile's last query, and where that key opens a new key tile of 64 the kernel
skips it. This script runs one request per case (pages of one token, as the
flashinfer backend's query pass does), predicts each case by that rule, and
reports where the kernel is wrong, and where the rule and the kernel disagree.
"""

import argparse
import json

import torch
from _args import require_cuda

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--heads", type=int, nargs="+",
               default=[1, 2, 4, 8, 10, 16, 20, 32, 40, 64, 96, 100, 127, 128, 129, 160, 192, 256, 512, 1024])
p.add_argument("--q-len", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 64, 200])
p.add_argument("--context", type=int, nargs="+", default=[0, 1, 57, 60, 63, 64, 100, 1000])
p.add_argument("--out", help="write the cases as JSON here")
args = p.parse_args()
require_cuda(p, "runs FlashInfer's MLA kernel")
import flashinfer  # noqa: E402  (after the CUDA check: the import needs no GPU, the run does)

DV, DR, SCALE, TILE_KV = 512, 64, 0.1, 64
dev, i32 = "cuda:0", dict(dtype=torch.int32, device="cuda:0")


def predicted_wrong(heads: int, q_len: int, kv_len: int) -> bool:
    """The floor rule above, tile by tile (one request: the tile is 128 rows past 64 packed rows)."""
    rows = q_len * heads
    tile = 128 if rows > 64 else 64
    for start in range(0, rows, tile):
        last_q = min(q_len - 1, (start + tile - 1) // heads)
        need = kv_len - q_len + last_q + 1
        got = min(kv_len, kv_len - q_len + (start + tile) // heads)
        if -(-got // TILE_KV) < -(-need // TILE_KV):
            return True
    return False


wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev))
gen = torch.Generator(device=dev).manual_seed(0)
cases = []
for h in args.heads:
    for q_len in args.q_len:
        for ctx in args.context:
            kv_len = ctx + q_len
            q = torch.randn(q_len, h, DV + DR, device=dev, generator=gen).bfloat16()
            kv = torch.randn(kv_len, 1, DV + DR, device=dev, generator=gen).bfloat16()
            wrapper.plan(torch.tensor([0, q_len], **i32), torch.tensor([0, kv_len], **i32),
                         torch.arange(kv_len, **i32), torch.tensor([kv_len], **i32), h, DV, DR, 1, True, SCALE,
                         torch.bfloat16, torch.bfloat16)
            out = wrapper.run(q[..., :DV], q[..., DV:], kv[..., :DV], kv[..., DV:])
            s = torch.einsum("qhd,kd->hqk", q.float(), kv[:, 0].float()) * SCALE
            seen = torch.arange(kv_len, device=dev)[None, :] <= ctx + torch.arange(q_len, device=dev)[:, None]
            ref = torch.einsum("hqk,kd->qhd", s.masked_fill(~seen, float("-inf")).softmax(-1), kv[:, 0, :DV].float())
            rel = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            cases.append(dict(heads=h, q_len=q_len, context=ctx, rel=rel, wrong=rel > 2e-2,
                              predicted=predicted_wrong(h, q_len, kv_len)))

wrong = [c for c in cases if c["wrong"]]
print(f"{len(cases)} cases, {len(wrong)} wrong; at heads {sorted({c['heads'] for c in wrong})}")
at_ctx0 = sorted({c["heads"] for c in wrong if not c["context"]})
print(f"wrong with context 0 (the query pass's shape): at heads {at_ctx0}")
pow2 = [c for c in wrong if c["heads"] <= 128 and c["heads"] & (c["heads"] - 1) == 0]
print(f"wrong at a power of two <= 128: {pow2}")
off = [c for c in cases if c["wrong"] != c["predicted"]]
print(f"the rule disagrees with the kernel in {len(off)} cases: {off[:10]}")
if args.out:
    with open(args.out, "w") as f:
        json.dump(cases, f, indent=0)
