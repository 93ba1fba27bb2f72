"""Build FlashInfer's JIT modules for one (layout, dtype) ahead of the tests, so several build at once.

    python3 benchmarks/jit_warm.py mla bfloat16     # BatchMLAPagedAttention (both masks)
    python3 benchmarks/jit_warm.py gqa float16      # paged + ragged prefill, head dim 128
    python3 benchmarks/jit_warm.py gqa bfloat16 --head-dim 256   # the same at another head dim

Runs one tiny layer call through the flashinfer backend; FlashInfer caches
what it compiles (~/.cache/flashinfer), so later processes only load it.
Run one at a time: FlashInfer runs every module's ninja in one directory,
with one deps log, and builds at once damage it, so that later processes
rebuild (benchmarks/jit_probe.sh; docs/backends.md, "0.6.0 and 0.6.9").
"""

import argparse
import time

import torch
from _args import require_cuda

from twostage_mla import AttentionConfig, DCPLayout, TwoStageAttention, synthetic

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("format", choices=("mla", "gqa"), help="the KV layout whose kernels to build")
p.add_argument("dtype", choices=("bfloat16", "float16"), help="the dtype they are built for")
p.add_argument("--head-dim", type=int, choices=(64, 128, 256), help="GQA only: the head dim to build (default 128)")
args = p.parse_args()
if args.format == "mla" and args.head_dim is not None:
    p.error("expected no --head-dim with mla (its kernels are built for 512 + 64)")
args.head_dim = args.head_dim or 128
require_cuda(p, "builds FlashInfer's CUDA kernels")
fmt, dtype = args.format, getattr(torch, args.dtype)
t0 = time.time()
if fmt == "mla":
    cfg = AttentionConfig.mla(num_heads=16, kv_lora_rank=512, rope_dim=64, page_size=64, scale=0.1)
else:
    cfg = AttentionConfig(8, args.head_dim, args.head_dim, 64, 0.1, num_kv_heads=2, kv_format="gqa")
mla = fmt == "mla"
# A chunk of 200 new tokens beside decode tokens, as the chunked-prefill test runs: FlashInfer built
# one more GQA module for it on the H200 (session 18).
step = synthetic.make_step([100, 0, 50], [2, 3, 200], heads=cfg.num_heads, head_dim=cfg.head_dim,
                           head_dim_v=cfg.head_dim_v, kv_heads=cfg.num_kv_heads, mla=mla, dtype=dtype)
x = synthetic.rank_inputs(step, DCPLayout(), 64, mla=mla, dtype=dtype, device="cuda:0")
for fuse in (False, True):  # FlashInfer's own (causal) query pass, and the fused Triton one
    attn = TwoStageAttention(cfg, DCPLayout(), backend="flashinfer", dtype=dtype, device="cuda:0", fuse_query=fuse)
    attn(x.q, x.k, x.v, x.k_cache, x.v_cache, attn.plan(x.query_start_loc, x.seq_lens, x.block_table))
torch.cuda.synchronize()
what = f"{fmt} {args.dtype}" + ("" if mla else f" d{args.head_dim}")
print(f"jit_warm {what}: ready in {time.time() - t0:.0f} s", flush=True)
