"""One DCP decode step with speculative tokens, as an engine would run it.

    torchrun --nproc-per-node 2 examples/torchrun_dcp_step.py            # gloo on CPUs
    torchrun --nproc-per-node 2 examples/torchrun_dcp_step.py --cuda     # NCCL, one GPU a rank

Every rank holds 1/N of each request's MLA latent cache (DeepSeek-V2-Lite
sizes) and its own share of the query heads. The step verifies q_len draft
tokens per request; the result is checked against a float64 oracle over the
unsharded cache. Read it top to bottom: each block is what an engine does.
"""

import argparse
import os

import torch
import torch.distributed as dist

from twostage_mla import AttentionConfig, DCPLayout, TwoStageAttention, oracle_attention
from twostage_mla.layout import kv_slots, local_pages

# --- model shapes: DeepSeek-V2-Lite's MLA; 16 heads split over the group (TP) -------------
HEADS, LORA, ROPE, PAGE = 16, 512, 64, 64
D = LORA + ROPE

p = argparse.ArgumentParser(description="One DCP step with draft tokens; start it with torchrun.")
p.add_argument("--cuda", action="store_true", help="NCCL, one GPU a rank (default: gloo on CPUs)")
p.add_argument("--interleave", type=int, default=1, help="I: tokens per rank in turn; divides the page size 64")
args = p.parse_args()
missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") if v not in os.environ]
if missing:
    p.error(f"expected to be started by torchrun ({', '.join(missing)} unset), e.g. torchrun --nproc-per-node 2 ...")
if args.interleave < 1 or PAGE % args.interleave:
    p.error(f"expected --interleave to divide the page size {PAGE}, got {args.interleave}")
if HEADS % int(os.environ["WORLD_SIZE"]):  # each rank keeps HEADS / N of them: the rest would silently go missing
    p.error(f"expected a group size that divides the {HEADS} heads, got {os.environ['WORLD_SIZE']} ranks")
if args.cuda and torch.cuda.device_count() < int(os.environ["LOCAL_WORLD_SIZE"]):
    p.error(f"expected a GPU for each of the {os.environ['LOCAL_WORLD_SIZE']} local ranks with --cuda, "
            f"found {torch.cuda.device_count()}")  # fmt: skip

# --- the process group: in an engine, the DCP group inside the TP group -----------------
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.cuda else torch.device("cpu")
if args.cuda:
    torch.cuda.set_device(device)
# device_id binds NCCL to this rank's GPU; without it NCCL guesses from the rank, and warns
dist.init_process_group("nccl" if args.cuda else "gloo", device_id=device if args.cuda else None)
group = dist.group.WORLD
dtype = torch.bfloat16 if args.cuda else torch.float32

# --- this rank's layer: its HEADS / N heads -----------------------------------------------
cfg = AttentionConfig.mla(num_heads=HEADS // world, kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=D**-0.5)
layout = DCPLayout(world, rank, args.interleave)
attn = TwoStageAttention(cfg, layout, group=group, combine="a2a", dtype=dtype, device=device)

# --- the batch: every rank sees the same metadata and the same new latents -----------------
torch.manual_seed(0)  # same "hidden states" on every rank, as after a TP all-reduce
context = [3000, 1, 1200]  # tokens already in the cache; 1 token leaves other ranks empty
q_lens = [4, 1, 8]  # draft tokens to verify per request
seq_lens = torch.tensor([c + q for c, q in zip(context, q_lens)], dtype=torch.int32)
query_start_loc = torch.tensor([0, 4, 5, 13], dtype=torch.int32)
all_kv = [torch.randn(int(n), 1, D).to(dtype) for n in seq_lens]  # stands in for the model's latents
q_all_heads = torch.randn(13, HEADS, D).to(dtype)  # absorbed queries of all heads

# --- this rank's paged cache: local_pages(seq_len) pages per request ----------------------
pages = [local_pages(int(s), world, args.interleave, rank, PAGE) for s in seq_lens]
width = max(local_pages(int(s), world, args.interleave, 0, PAGE) for s in seq_lens)  # same on every rank
block_table = torch.full((len(pages), width), -1, dtype=torch.int32)  # -1: a page this rank does not use
next_page = 0
for b, n in enumerate(pages):  # a real engine's allocator hands these out
    block_table[b, :n] = torch.arange(next_page, next_page + n)
    next_page += n
kv_cache = torch.zeros(next_page, PAGE, 1, D, dtype=dtype, device=device)
block_table = block_table.to(device)

# --- prefill (earlier steps): write each request's context into this rank's shard ---------
for b, c in enumerate(context):
    slots = kv_slots(torch.arange(c), torch.full((c,), b), block_table.cpu(), PAGE, layout)
    mine = slots >= 0
    kv_cache.view(-1, 1, D)[slots[mine].to(device)] = all_kv[b][:c][mine].to(device)

# --- the step: plan once (host sync allowed), then per layer --------------------------------
plan = attn.plan(query_start_loc.to(device), seq_lens.to(device), block_table)
kv_new = torch.cat([kv[c:] for kv, c in zip(all_kv, context)]).to(device)  # (T, 1, D)
q = q_all_heads[:, rank * cfg.num_heads : (rank + 1) * cfg.num_heads].to(device)  # local heads

plan.write_new_tokens(kv_cache, kv_new)  # engines write the step's latents before attention
out = attn(q, kv_new, None, kv_cache, None, plan)  # (T, H_loc, 512); repeat per layer

# --- check against the float64 oracle over the unsharded cache ------------------------------
kv = torch.cat(all_kv)
ref, _ = oracle_attention(q_all_heads, kv, kv[..., :LORA], query_start_loc, seq_lens, cfg.scale)
ref = ref[:, rank * cfg.num_heads : (rank + 1) * cfg.num_heads]
err = ((out.double().cpu() - ref).abs().max() / ref.abs().max()).item()
for r in range(world):  # one rank at a time, so lines do not interleave
    if r == rank:
        print(f"rank {rank}/{world}: out {tuple(out.shape)} {out.dtype}, max_rel_err vs oracle {err:.2e}", flush=True)
    dist.barrier()
dist.destroy_process_group()
if not err <= (1e-5 if dtype == torch.float32 else 2e-2):  # float32 rounding; bf16 inputs' rounding
    raise SystemExit(f"rank {rank}: max_rel_err {err:.2e} above the tolerance for {dtype}")
