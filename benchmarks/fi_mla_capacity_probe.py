"""FlashInfer's MLA planner past 16384 work items: its output against a float32 reference, and the layer's refusal.

    python3 benchmarks/fi_mla_capacity_probe.py --out fi_mla_capacity.json

MLAPlan (scheduler.cuh) cuts each request's packed rows (query x head) into
tiles of 64 or 128 rows, splits the keys of some, and copies the resulting
work items into buffers of 16384 entries each, unchecked in FlashInfer 0.5.3.
This script runs the non-causal MLA pass (the layer's context pass) below and
past that count, a process per case, reports each case's error against a
float32 reference (NaN counts as wrong), the fault that ended its process, or
FlashInfer's own refusal in releases that have one, then checks that
TwoStageAttention refuses the steps past the bound at plan time. On an H200
with 0.5.3 (session 22): see docs/backends.md, "FlashInfer releases".
"""

import argparse
import json
import math
import subprocess
import sys
import warnings

import torch
from _args import require_cuda

from twostage_mla import AttentionConfig, DCPLayout, TwoStageAttention
from twostage_mla.backends.flashinfer import _mla_work_bound

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--heads", type=int, default=128)
p.add_argument("--context", type=int, default=512, help="keys per request")
p.add_argument("--cases", default="1x8192,1x16000,256x48,1x18432,256x80,1x24576",
               help="requests x queries per request, comma-separated; each runs in a process of its own, as a "
                    "fault in FlashInfer's kernel leaves the CUDA context unusable")
p.add_argument("--one", help=argparse.SUPPRESS)  # a child process: this one case, one JSON line out
p.add_argument("--out", help="write the cases as JSON here")
args = p.parse_args()
require_cuda(p, "runs FlashInfer's MLA kernel")
import flashinfer  # noqa: E402  (after the CUDA check)

warnings.simplefilter("ignore", DeprecationWarning)  # later releases deprecate 0.5.3's plan/run forms
DV, DR, SCALE, PAGE = 512, 64, 0.1, 64
dev, i32 = "cuda:0", dict(dtype=torch.int32, device="cuda:0")
num_sm = torch.cuda.get_device_properties(dev).multi_processor_count
kernel = "fa3" if flashinfer.utils.is_sm90a_supported(torch.device(dev)) else "fa2"
h, c = args.heads, args.context
pages_per = -(-c // PAGE)


def run_case(b: int, q_len: int) -> dict:
    """FlashInfer's non-causal MLA pass over b requests of q_len queries and c keys, against float32."""
    t = b * q_len
    cluster = 2 if q_len * h > 64 else 1
    case = dict(requests=b, q_len=q_len, heads=h, context=c, tiles=b * -(-q_len * h // (64 * cluster)),
                bound=_mla_work_bound(t, b, h, num_sm))
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(t, h, DV + DR, device=dev, generator=gen).bfloat16()
    cache = torch.randn(b * pages_per, PAGE, DV + DR, device=dev, generator=gen).bfloat16()
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev),
                                                           backend=kernel)
    try:
        wrapper.plan(torch.arange(0, t + 1, q_len, **i32), torch.arange(0, b * pages_per + 1, pages_per, **i32),
                     torch.arange(b * pages_per, **i32), torch.full((b,), c, **i32), h, DV, DR, PAGE, False, SCALE,
                     torch.bfloat16, torch.bfloat16)
    except Exception as e:  # a release that refuses the plan
        return {**case, "refused": f"{type(e).__name__}: {str(e)[:200]}"}
    out = wrapper.run(q[..., :DV], q[..., DV:], cache[..., :DV], cache[..., DV:]).float()
    err = 0.0
    keys = cache.view(b, pages_per * PAGE, DV + DR)[:, :c].float()
    for r in range(b):  # float32 reference, a request at a time, 2048 queries at a time
        for s in range(0, q_len, 2048):
            rows = slice(r * q_len + s, r * q_len + min(s + 2048, q_len))
            w = torch.einsum("qhd,kd->qhk", q[rows].float(), keys[r]).mul_(SCALE).softmax(-1)
            ref = torch.einsum("qhk,kd->qhd", w, keys[r, :, :DV])
            e = ((out[rows] - ref).abs().max() / ref.abs().max()).item()
            err = max(err, e if math.isfinite(e) else math.inf)  # NaN in the output counts as wrong
    return {**case, "rel": err, "wrong": err > 2e-2, "nonfinite": int((~out.isfinite()).sum())}


if args.one:
    print(json.dumps(run_case(*map(int, args.one.split("x")))), flush=True)
    sys.exit(0)

cases = []
for spec in args.cases.split(","):
    r = subprocess.run([sys.executable, __file__, "--one", spec, "--heads", str(h), "--context", str(c)],
                       capture_output=True, text=True, timeout=300)
    line = r.stdout.strip().splitlines()[-1:] if r.returncode == 0 else []
    b, q_len = map(int, spec.split("x"))
    cases.append(json.loads(line[0]) if line else dict(
        requests=b, q_len=q_len, heads=h, context=c, bound=_mla_work_bound(b * q_len, b, h, num_sm),
        fault=(r.stderr.strip().splitlines() or ["?"])[-1][:200]))
    print(cases[-1], flush=True)

print(f"FlashInfer {flashinfer.__version__} ({kernel}), {num_sm} SMs, {h} heads, context {c}:")
for cs in cases:
    what = cs.get("refused") or cs.get("fault") or f"rel err {cs['rel']:.2e}, {cs['nonfinite']} non-finite" + (
        " WRONG" if cs["wrong"] else "")
    print(f"  {cs['requests']} x {cs['q_len']}: bound {cs['bound']} work items: {what}")

# The layer: a step whose bound is past the planner's capacity is refused at plan time.
cfg = AttentionConfig.mla(num_heads=h, kv_lora_rank=DV, rope_dim=DR, page_size=PAGE, scale=SCALE)
attn = TwoStageAttention(cfg, DCPLayout(), backend="flashinfer", dtype=torch.bfloat16, device=dev)
for cs in cases:
    b, q_len = cs["requests"], cs["q_len"]
    seq = torch.full((b,), c + q_len, **i32)
    table = torch.arange(b * -(-(c + q_len) // PAGE), **i32).view(b, -1)
    try:
        attn.plan(torch.arange(0, b * q_len + 1, q_len, **i32), seq, table)
        cs["layer"] = "planned"
    except ValueError as e:
        cs["layer"] = f"refused: {str(e)[:160]}"
    print(f"  layer at {b} x {q_len}: {cs['layer']}", flush=True)
    assert (cs["layer"] == "planned") == (cs["bound"] <= 16384), cs
if args.out:
    with open(args.out, "w") as f:
        json.dump(dict(flashinfer=flashinfer.__version__, kernel=kernel, num_sm=num_sm, cases=cases), f, indent=1)
