"""Argument checks the benchmark scripts share: a bad value is refused by name (argparse's exit 2),
before any GPU work or process starts, rather than surfacing as a traceback from inside a kernel."""

from __future__ import annotations

import argparse
import os

import torch


def require_cuda(p: argparse.ArgumentParser, what: str = "times kernels on one") -> None:
    if not torch.cuda.is_available():
        p.error(f"expected a CUDA GPU (this script {what}), found none")


def require_at_least(p: argparse.ArgumentParser, a: argparse.Namespace, lo: int, *names: str) -> None:
    """Every value of each option (a list where nargs="+") >= lo."""
    for name in names:
        values = getattr(a, name)
        for v in values if isinstance(values, list) else [values]:
            if v < lo:
                p.error(f"expected --{name.replace('_', '-')} >= {lo}, got {v}")


def require_powers_of_two(p: argparse.ArgumentParser, a: argparse.Namespace, lo: int, *names: str) -> None:
    for name in names:
        for v in getattr(a, name):
            if v < lo or v & (v - 1):
                p.error(f"expected --{name.replace('_', '-')} powers of two >= {lo}, got {v}")


def require_writable(p: argparse.ArgumentParser, path: str | None, flag: str = "--out") -> None:
    """The output's folder exists: checked first, not after minutes of timing."""
    folder = os.path.dirname(os.path.abspath(path)) if path else None
    if folder and not os.path.isdir(folder):
        p.error(f"expected {flag} in an existing folder, got {path!r} ({folder} does not exist)")
