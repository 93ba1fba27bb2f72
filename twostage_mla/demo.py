"""The main job: one realistic DCP step on N local processes, checked and timed.

Starts N processes (gloo on CPUs; NCCL with one GPU per rank where there are
enough GPUs), gives each its shard of a paged MLA cache with DeepSeek-V2-Lite's
dimensions, runs the two-stage layer, compares every rank's heads with the
float64 oracle and reports the error and the time of each phase. The error
fails (``ok`` false; ``twostage-mla demo`` exits 1) past ``check``'s
tolerance for the dtype.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from twostage_mla import synthetic
from twostage_mla.backends import select_backend
from twostage_mla.check import DTYPES, TOLERANCE, verdict
from twostage_mla.comm import COMBINE_METHODS
from twostage_mla.layer import CONTEXT_PASSES, PHASES, AttentionConfig, TwoStageAttention, _spec
from twostage_mla.layout import DCPLayout


def _opt(default, help: str):
    """A DemoArgs field with its --help text."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class DemoArgs:
    world_size: int = _opt(2, "N: ranks of the DCP group, one process each")
    interleave: int = _opt(1, "I: consecutive tokens per rank (token p on rank (p // I) % N)")
    heads: int = _opt(16, "query heads of the model, split over the group (tensor parallel)")
    kv_lora_rank: int = _opt(512, "MLA latent width (V's head dim)")
    rope_dim: int = _opt(64, "MLA rope width (K's head dim = kv_lora_rank + rope_dim)")
    page_size: int = _opt(64, "tokens per cache page, a multiple of interleave")
    batch: int = _opt(8, "requests in the step")
    min_context: int = _opt(1000, "shortest context of a request, in tokens")
    max_context: int = _opt(4000, "longest context of a request, in tokens")
    max_q_len: int = _opt(8, "new tokens per request: 1 .. max_q_len mixed in the batch, max_q_len always present")
    dtype: str = _opt("auto", "auto (bfloat16 on GPUs, float32 on CPUs), float32, bfloat16, float16 (or fp32, ...)")
    combine: str = _opt("a2a", "cross-rank combine: a2a (one all-to-all) or ag_rs (all-gather + reduce-scatter)")
    backend: str = _opt("auto", "attention backend: auto (the fastest that serves) or one by name")
    context_pass: str = _opt("split", "split, expand (the context pass per token over its causal prefix, new "
                             "tokens read from the cache) or auto (expand where the backend measured it faster)")
    device: str = _opt("auto", "auto (cuda if there are world_size GPUs, else cpu), cpu or cuda")
    iters: int = _opt(5, "layer calls timed")
    seed: int = _opt(0, "seed of the random step")


def _host_bytes_needed(a: DemoArgs) -> int:
    """Roughly what the workers hold at once on the host: each builds the whole step's K/V (with its
    shard and a copy) next to torch itself; rank 0 adds the float64 oracle of every head for the
    longest request (its K/V, scores and softmax)."""
    d, n = a.kv_lora_rank + a.rope_dim, a.max_context + a.max_q_len
    oracle = n * (d + a.kv_lora_rank) * 8 + 3 * a.heads * a.max_q_len * n * 8
    # The shard holds whole pages: at least one per request, however short, and two spare ones.
    local = -(-n // a.world_size) + a.interleave
    shard = (a.batch * -(-local // a.page_size) + 2) * a.page_size * d * 4
    return a.world_size * (a.batch * n * d * 4 + 2 * shard + 3 * 2**27) + oracle  # torch itself: ~0.25 - 0.4 GiB


def _host_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on every platform: then no limit
        return 2**63


def resolve_device(world_size: int, device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"expected at least world_size = {world_size} GPUs for device='cuda', found {torch.cuda.device_count()}"
        )
    if device not in ("cpu", "cuda"):
        raise ValueError(f"expected device 'auto', 'cpu' or 'cuda', got {device!r}")
    return device


def _config(a: DemoArgs) -> AttentionConfig:
    """Each rank's layer: its share of the heads."""
    scale = (a.kv_lora_rank + a.rope_dim) ** -0.5  # 1/sqrt(D) for random data; a model passes its own scale
    return AttentionConfig.mla(
        num_heads=a.heads // a.world_size,
        kv_lora_rank=a.kv_lora_rank,
        rope_dim=a.rope_dim,
        page_size=a.page_size,
        scale=scale,
    )


def _step_shape(a: DemoArgs) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(a.seed)
    ctx = torch.randint(a.min_context, a.max_context + 1, (a.batch,), generator=g).tolist()
    # q_len 1 .. max_q_len: every value where the batch has room, else spread over it with the
    # longest always present (a batch of one runs max_q_len tokens, not a plain decode).
    b, m = a.batch, a.max_q_len
    if b >= m:
        ql = [1 + i % m for i in range(b)]
    else:
        ql = [m - round((b - 1 - i) * (m - 1) / max(b - 1, 1)) for i in range(b)]
    return ctx, ql


def _worker(rank: int, a: DemoArgs, device: str, init: str, out_path: str) -> None:
    # Stdout is the parent's report (or JSON): what a rank's libraries print there goes to stderr
    # (torch 2.8's gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks" from C++, at the fd).
    sys.stdout.flush()
    os.dup2(2, 1)
    backend_name = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:  # N ranks share the CPUs; one thread each also keeps float32 exact (tests/conftest.py says why)
        torch.set_num_threads(1)
    # device_id binds NCCL to this rank's GPU (without it NCCL guesses from the rank, and warns)
    gpu = torch.device("cuda", rank) if device == "cuda" else None
    dist.init_process_group(backend_name, init_method=init, rank=rank, world_size=a.world_size, device_id=gpu)
    try:
        dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
        dtype = getattr(torch, a.dtype)
        cfg = _config(a)
        layout = DCPLayout(a.world_size, rank, a.interleave)
        ctx, ql = _step_shape(a)
        step = synthetic.make_step(
            ctx, ql, heads=a.heads, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v, dtype=dtype, seed=a.seed
        )
        x = synthetic.rank_inputs(step, layout, a.page_size, mla=True, dtype=dtype, device=dev, seed=a.seed)
        attn = TwoStageAttention(cfg, layout, group=dist.group.WORLD, combine=a.combine, backend=a.backend,
                                 dtype=dtype, device=dev, context_pass=a.context_pass)  # fmt: skip
        attn.plan(x.query_start_loc, x.seq_lens, x.block_table)  # the first plan also loads the backend's kernels
        t0 = time.perf_counter()
        plan = attn.plan(x.query_start_loc, x.seq_lens, x.block_table)
        plan_s = time.perf_counter() - t0
        # The step's latents this rank owns, into its shard, as an engine does before attention (the
        # shard here holds them already; the expanded context pass reads them there).
        plan.write_new_tokens(x.k_cache, x.k)
        out = attn(x.q, x.k, None, x.k_cache, None, plan)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        # Only rank 0 reports phases, so only it profiles. Rare aborts of a non-zero rank on CPU
        # ("terminate called without an active exception") point at a profile left unread there.
        with _quiet_profile(activities) if rank == 0 else contextlib.nullcontext() as prof:
            for _ in range(a.iters):
                out = attn(x.q, x.k, None, x.k_cache, None, plan)
            if device == "cuda":
                torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            out = attn(x.q, x.k, None, x.k_cache, None, plan)
        if device == "cuda":
            torch.cuda.synchronize()
        layer_s = (time.perf_counter() - t0) / a.iters

        h = cfg.num_heads
        ref, _ = synthetic.oracle(step, cfg.scale) if rank == 0 else (None, None)
        outs = [torch.empty_like(out) for _ in range(a.world_size)] if rank == 0 else None
        dist.gather(out.contiguous(), outs, dst=0)
        if rank == 0:
            err, rel, ok = verdict(torch.cat(outs, dim=1), ref, dtype)  # rank-major heads, as the oracle's
            phases = {}
            for e in prof.key_averages():
                if e.key in PHASES:
                    dev_us = getattr(e, "device_time_total", 0.0) if device == "cuda" else 0.0
                    phases[e.key] = (dev_us or e.cpu_time_total) / a.iters
            result = {
                "ok": ok,
                "tolerance": TOLERANCE[dtype],
                "max_abs_err": err,
                "max_rel_err": rel,
                "world_size": a.world_size,
                "interleave": a.interleave,
                "backend": attn.backend.name,
                "combine": a.combine,
                "dtype": a.dtype,
                "device": device if device == "cpu" else torch.cuda.get_device_name(rank),
                "dist_backend": backend_name,
                "heads_per_rank": h,
                "batch": a.batch,
                "context_lens": ctx,
                "q_lens": ql,
                "tokens": plan.num_tokens,
                "plan_ms": plan_s * 1e3,
                "layer_ms": layer_s * 1e3,
                "fused_query": attn.query_merge is not None,  # then the query pass runs inside the merge
                "context_pass": "split" if plan.context_plan is None else "expand",  # what this step ran
                "phase_us": {k: phases.get(k, 0.0) for k in PHASES},
            }
            torch.save(result, out_path)
        dist.barrier()  # no rank tears its group down while rank 0 still receives
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _quiet_profile(activities: list[ProfilerActivity]):
    """torch.profiler.profile, less the lines its C++ (kineto) prints on stderr as it starts and stops.

    Those lines ("USDT: ... profiler_start") were the first a user saw of the main job. Only the
    start and the stop are silenced, so anything the profiled layer calls print still shows.
    """
    prof = profile(activities=activities)
    with _no_stderr():
        prof.start()
    try:
        yield prof
    finally:
        with _no_stderr():
            prof.stop()


@contextlib.contextmanager
def _no_stderr():
    """File descriptor 2 to /dev/null for a while: C++ writes there, past sys.stderr."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_demo(args: DemoArgs) -> dict:
    """Run the demo on ``args.world_size`` local processes; returns rank 0's report."""
    if args.heads < 1:
        raise ValueError(f"expected heads >= 1, got {args.heads}")
    if args.world_size < 1 or args.heads % args.world_size:
        raise ValueError(f"expected world_size >= 1 dividing heads = {args.heads}, got world_size = {args.world_size}")
    # Everything a worker would refuse is checked here, before processes start.
    for name in ("interleave", "page_size", "batch", "max_q_len", "iters", "kv_lora_rank", "rope_dim"):
        lo = 0 if name == "rope_dim" else 1  # MLA without a rope part is still MLA (V = K)
        if getattr(args, name) < lo:
            raise ValueError(f"expected {name} >= {lo}, got {getattr(args, name)}")
    if args.page_size % args.interleave:
        raise ValueError(f"expected page_size to be a multiple of interleave = {args.interleave}, got {args.page_size}")
    if not 0 <= args.min_context <= args.max_context:
        raise ValueError(f"expected 0 <= min_context <= max_context, got {args.min_context}, {args.max_context}")
    if not 0 <= args.seed < 2**32:  # each rank seeds seed + 7919 x rank: far from the generator's 64-bit limit
        raise ValueError(f"expected 0 <= seed < 2**32, got {args.seed}")
    if args.combine not in COMBINE_METHODS:
        raise ValueError(f"expected combine in {COMBINE_METHODS}, got {args.combine!r}")
    if args.context_pass not in CONTEXT_PASSES:
        raise ValueError(f"expected context_pass in {CONTEXT_PASSES}, got {args.context_pass!r}")
    need, have = _host_bytes_needed(args), _host_bytes()
    if need > have:
        raise ValueError(
            f"expected world_size x batch x max_context (in pages of page_size) to fit this machine's memory: the "
            f"workers' synthetic K/V and float64 oracle need about {need / 2**30:.0f} GiB, {have / 2**30:.0f} GiB "
            f"here (got world_size {args.world_size}, batch {args.batch}, max_context {args.max_context}, "
            f"page_size {args.page_size})"
        )
    device = resolve_device(args.world_size, args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    if dtype not in DTYPES:  # check's names, the short ones too
        raise ValueError(f"expected dtype auto, float32, bfloat16, float16 (or fp32, bf16, fp16), got {dtype!r}")
    dtype = str(DTYPES[dtype]).removeprefix("torch.")
    args = DemoArgs(**{**asdict(args), "dtype": dtype, "device": device})
    # The registry's own check, here before processes start: an unknown name, or a backend that
    # cannot serve the workers' layer (with its reasons).
    select_backend(_spec(_config(args), args.world_size, getattr(torch, dtype), torch.device(device)), args.backend)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.pt")
        init = f"tcp://127.0.0.1:{_free_port()}"
        mp.start_processes(_worker, args=(args, device, init, out_path), nprocs=args.world_size, start_method="spawn")
        return torch.load(out_path)


def format_report(r: dict) -> str:
    lines = [
        f"twostage-mla demo: N={r['world_size']} I={r['interleave']} backend={r['backend']} "
        f"combine={r['combine']} dtype={r['dtype']} context_pass={r.get('context_pass', 'split')} on {r['device']} "
        f"({r['dist_backend']})",
        f"  batch {r['batch']}, {r['heads_per_rank']} heads per rank, contexts {min(r['context_lens'])}.."
        f"{max(r['context_lens'])}, q_len {min(r['q_lens'])}..{max(r['q_lens'])} ({r['tokens']} tokens)",
        f"  vs float64 oracle: max_abs_err {r['max_abs_err']:.3e}  max_rel_err {r['max_rel_err']:.3e}  "
        + ("ok" if r["ok"] else f"FAIL (> {r['tolerance']})"),
        f"  plan {r['plan_ms']:.2f} ms (once per step), layer {r['layer_ms']:.2f} ms (rank 0, wall clock)",
        "  phase                     time per layer (rank 0, profiler)",
    ]
    for k, v in r["phase_us"].items():
        if k == PHASES[0] and r.get("context_pass") == "expand":
            lines.append(f"    {k:<24}   (none: the expanded context pass saw the new tokens)")
        elif k == PHASES[0] and r.get("fused_query"):
            lines.append(f"    {k:<24}   (in the merge: one fused kernel)")
        else:
            lines.append(f"    {k:<24}{v:>10.1f} us")
    if r["world_size"] > 1 and r["dist_backend"] == "nccl":
        # Measured: 11 - 630 us for the same eager step from run to run, against ~30 us graphed.
        lines.append("  (eager: a collective's device time includes waiting for the other ranks' launches;")
        lines.append("   graphed costs are in docs/cost_model.md)")
    return "\n".join(lines)
