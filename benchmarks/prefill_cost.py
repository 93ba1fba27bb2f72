"""Chunked prefill with context under DCP: gather the context KV, or move q and o (the split)?

Per layer, a step of T new tokens over C context tokens sharded on N ranks
(H = N * H_loc heads in the group, MLA widths D = kv_lora_rank + rope_dim,
Dv = kv_lora_rank) can either

  gather_kv    all-gather every rank's shard of the context latents (what the
               engines do for prefill today), then attend locally:
               (N-1)/N * C * D * e bytes received per rank;
  split_a2a    all-gather q, then one all-to-all of (o, lse) (this library):
               (N-1)/N * T * H * (D*e + Dv*e + 4);
  split_ag_rs  all-gather q, all-gather lse, reduce-scatter o in float32:
               (N-1)/N * T * H * (D*e + 4*Dv) + (N-1) * T * H * 4.

This script times exactly those collectives, with twostage_mla.comm's own
functions for the split, on N GPUs over NCCL (CUDA events, median of
``--iters`` after ``--warmup``), next to the bytes of docs/cost_model.md.
The attention arithmetic is the same in both (every head sees every context
key once), so it is left out. gather_kv is timed as one all-gather of a packed
buffer; packing the paged shard before and reordering after cost extra
copies there, so its figure is a lower bound.

    python benchmarks/prefill_cost.py                      # 2 GPUs, NCCL, bf16
    python benchmarks/prefill_cost.py --graph              # each method captured in a CUDA graph and replayed:
                                                           # no host time, what a graphed decode step pays
    python benchmarks/prefill_cost.py --device cpu --tokens 4 16 --contexts 1024 8192 \\
        --heads-per-rank 2 --iters 3 --warmup 1            # smoke test: gloo on CPUs

Writes a table to stdout and JSON (rows + environment) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _args import require_at_least

from twostage_mla import comm

# NVLink multicast stays off (shared machines); NCCL reads this at init.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def predicted_bytes(n: int, t: int, h: int, c: int, d: int, dv: int, e: int) -> dict[str, float]:
    """Bytes each rank receives per layer (see docs/cost_model.md); h = heads of the whole group."""
    f = (n - 1) / n
    return {
        "gather_kv": f * c * d * e,
        "split_a2a": f * t * h * (d * e + dv * e + 4),
        "split_ag_rs": f * t * h * (d * e + 4 * dv) + (n - 1) * t * h * 4,
        "q_gather": f * t * h * d * e,
    }


def _timer(device: torch.device, group, iters: int, warmup: int):
    """Median seconds of fn() on this rank, ranks aligned by a barrier before each sample."""

    def run(fn) -> float:
        samples = []
        for i in range(warmup + iters):
            dist.barrier(group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                dt = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
            if i >= warmup:
                samples.append(dt)
        return statistics.median(samples)

    return run


def _graphed(fn, device: torch.device):
    """fn captured in a CUDA graph; returns its replay (and keeps the graph alive through the closure)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside capture: NCCL sets up its channels on first use
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _q_gather(q, group, n):
    buf, work = comm.gather_queries(q, group)
    work.wait()
    return comm.from_rank_major(buf, 1)  # (T, N*H_loc, D), as the context pass takes it


def _split_a2a(q, o_c, lse_c, group, n):
    _q_gather(q, group, n)
    # The layer's a2a step: one all-to-all of (o, lse); their merge is fused into the final merge.
    return comm.exchange_a2a(comm.to_rank_major(o_c, n, 1), comm.to_rank_major(lse_c, n, 1), group)


def _split_ag_rs(q, o_c, lse_c, group, n, rank):
    _q_gather(q, group, n)
    return comm.combine_ag_rs(comm.to_rank_major(o_c, n, 1), comm.to_rank_major(lse_c, n, 1), group)


def _worker(rank: int, a: argparse.Namespace, init: str, out_path: str) -> None:
    n = a.world_size
    if a.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    gpu = device if a.device == "cuda" else None  # binds NCCL to this rank's GPU
    name = "nccl" if a.device == "cuda" else "gloo"
    dist.init_process_group(name, init_method=init, rank=rank, world_size=n, device_id=gpu)
    group = dist.group.WORLD
    dtype = getattr(torch, a.dtype)
    e = torch.empty((), dtype=dtype).element_size()
    d, dv = a.kv_lora_rank + a.rope_dim, a.kv_lora_rank
    eager_timer = _timer(device, group, a.iters, a.warmup)

    def timer(fn) -> float:
        return eager_timer(_graphed(fn, device) if a.graph else fn)
    rows = []
    try:
        for h_loc in a.heads_per_rank:
            h = n * h_loc
            for t in a.tokens:
                # The split's buffers depend on T only: one set per T.
                q = torch.randn(t, h_loc, d, device=device, dtype=dtype)
                o_c = torch.randn(t, h, dv, device=device, dtype=dtype)  # context pass output, all group heads
                lse_c = torch.randn(t, h, device=device, dtype=torch.float32)
                split_gib = (n * t * h_loc * d * e + t * h * dv * (e + 8)) / 2**30
                if split_gib > a.max_gib:
                    continue

                t_q = timer(partial(_q_gather, q, group, n))
                t_a2a = timer(partial(_split_a2a, q, o_c, lse_c, group, n))
                t_agrs = timer(partial(_split_ag_rs, q, o_c, lse_c, group, n, rank))
                for c in a.contexts:
                    if c * d * e / 2**30 * 2 > a.max_gib:
                        continue
                    local = torch.randn(-(-c // n), d, device=device, dtype=dtype)  # this rank's shard, packed
                    full = torch.empty(n * local.shape[0], d, device=device, dtype=dtype)
                    t_kv = timer(partial(_all_gather, full, local, group=group))
                    local = full = None
                    pb = predicted_bytes(n, t, h, c, d, dv, e)
                    rows.append(
                        dict(
                            heads_per_rank=h_loc,
                            group_heads=h,
                            tokens=t,
                            context=c,
                            ms=dict(gather_kv=t_kv * 1e3, split_a2a=t_a2a * 1e3, split_ag_rs=t_agrs * 1e3,
                                    q_gather=t_q * 1e3),
                            predicted_bytes=pb,
                            gather_over_split_a2a=t_kv / t_a2a,
                            predicted_gather_over_split_a2a=pb["gather_kv"] / pb["split_a2a"],
                        )
                    )
                q = o_c = lse_c = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if rank == 0:
            env = dict(
                torch=torch.__version__,
                device=torch.cuda.get_device_name(rank) if device.type == "cuda" else "cpu",
                nccl=".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
                dist_backend=dist.get_backend(group),
                world_size=n,
                dtype=a.dtype,
                kv_lora_rank=a.kv_lora_rank,
                rope_dim=a.rope_dim,
                iters=a.iters,
                warmup=a.warmup,
                command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
                graph=a.graph,
            )
            torch.save(dict(env=env, rows=rows), out_path)
    finally:
        dist.destroy_process_group()


def crossover(rows: list[dict]) -> list[dict]:
    """Per (heads, T): the smallest measured C at which the split (a2a) beats gathering KV."""
    out = []
    keys = sorted({(r["heads_per_rank"], r["tokens"]) for r in rows})
    for h_loc, t in keys:
        rs = sorted((r for r in rows if (r["heads_per_rank"], r["tokens"]) == (h_loc, t)), key=lambda r: r["context"])
        win = next((r["context"] for r in rs if r["gather_over_split_a2a"] > 1), None)
        out.append(dict(heads_per_rank=h_loc, tokens=t, measured_min_context=win))
    return out


def format_table(res: dict) -> str:
    env = res["env"]
    lines = [
        f"prefill_cost: N={env['world_size']} on {env['device']} ({env['dist_backend']}, NCCL {env['nccl']}), "
        f"{env['dtype']}, D={env['kv_lora_rank'] + env['rope_dim']} Dv={env['kv_lora_rank']}, torch {env['torch']}"
        + (", CUDA graphs" if env.get("graph") else ", eager"),
        f"{'H_loc':>5} {'T':>6} {'C':>8} | {'gather_kv':>10} {'split_a2a':>10} {'split_ag_rs':>11} {'q_gather':>9} ms"
        f" | {'MB kv':>8} {'MB a2a':>8} | gather/split measured  predicted",
    ]
    for r in res["rows"]:
        ms, pb = r["ms"], r["predicted_bytes"]
        lines.append(
            f"{r['heads_per_rank']:>5} {r['tokens']:>6} {r['context']:>8} | {ms['gather_kv']:>10.4f} "
            f"{ms['split_a2a']:>10.4f} {ms['split_ag_rs']:>11.4f} {ms['q_gather']:>9.4f}   "
            f"| {pb['gather_kv'] / 1e6:>8.2f} {pb['split_a2a'] / 1e6:>8.2f} | "
            f"{r['gather_over_split_a2a']:>8.2f}x {r['predicted_gather_over_split_a2a']:>10.2f}x"
        )
    lines.append("smallest measured context at which split_a2a beats gather_kv (None: not within the grid):")
    for x in crossover(res["rows"]):
        lines.append(f"  H_loc={x['heads_per_rank']:>3} T={x['tokens']:>6}: C >= {x['measured_min_context']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--heads-per-rank", type=int, nargs="+", default=[16, 64],
                   help="H_loc; DeepSeek-V3's 128 heads over TP 8 -> 16, over TP 2 -> 64")
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024, 4096, 16384])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536, 262144, 1048576])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-gib", type=float, default=24.0, help="skip grid points whose buffers exceed this")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays of each method (cuda only)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/prefill_cost_<device>.json)")
    a = p.parse_args(argv)
    if a.world_size < 2:  # at N = 1 no byte crosses ranks: both methods cost nothing, and the ratio is 0 / 0
        p.error(f"expected --world-size >= 2 (a group to move bytes across), got {a.world_size}")
    require_at_least(p, a, 1, "heads_per_rank", "kv_lora_rank", "tokens", "contexts", "iters")
    require_at_least(p, a, 0, "rope_dim", "warmup")
    if not a.max_gib > 0:
        p.error(f"expected --max-gib > 0, got {a.max_gib}")
    if a.graph and a.device != "cuda":
        p.error("--graph expected --device cuda (CUDA graphs)")
    if a.device == "cuda" and torch.cuda.device_count() < a.world_size:
        p.error(f"expected {a.world_size} GPUs for --device cuda, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        path = os.path.join(tmp, "res.pt")
        mp.start_processes(_worker, args=(a, init, path), nprocs=a.world_size, start_method="spawn")
        res = torch.load(path, weights_only=False)
    print(format_table(res))
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"prefill_cost_{a.device}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(res, crossover=crossover(res["rows"])), f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
