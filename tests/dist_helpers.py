"""Run a function on N local gloo ranks and collect what each returns."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, init: str, out_dir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # the ranks share the CPUs; see conftest.py for why one thread each
    # A short timeout turns a rank stuck in a collective into a failure, not a hang.
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        torch.save(fn(rank, world, *args), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args) -> list:
    """fn(rank, world, *args) on ``world`` processes (a gloo group each); the results by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        init = f"tcp://127.0.0.1:{_free_port()}"
        mp.start_processes(_entry, args=(world, init, out_dir, fn, args), nprocs=world, start_method="spawn")
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)]
