"""The benchmark scripts refuse bad arguments by name (exit 2) before any GPU work: no traceback from a
kernel, no default launch timed under another label, no minutes of timing lost to a missing folder."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

NO_CUDA = "expected a CUDA GPU (this script times kernels on one), found none"
CASES = [
    ("context_probe", "--context=-5", "expected --context >= 1, got -5"),
    ("context_probe", "--heads 16 0", "expected --heads >= 1, got 0"),
    ("dcp_rank_probe", "--page-size 0", "expected --page-size >= 1, got 0"),
    ("dcp_rank_probe", "--world-size 8 -1", "expected --world-size >= 1, got -1"),
    ("query_merge_sweep", "--block-h 0", "expected --block-h powers of two >= 16, got 0"),
    ("query_merge_sweep", "--block-v 128 96", "expected --block-v powers of two >= 16, got 96"),
    ("query_merge_sweep", "--warps 3", "expected --warps powers of two >= 1, got 3"),
    ("query_merge_sweep", "--states -1", "expected --states >= 0, got -1"),
    ("query_merge_sweep", "--prev /no/such/kernel.py", "expected --prev to be a Python file holding"),
    ("flex_probe", "--smoke --out /no/such/folder/x.json", "expected --out in an existing folder"),
    ("spread_probe", "--context 1", "expected --context >= 2, got 1"),
    ("spread_probe", "--out /no/such/folder/x.json", "expected --out in an existing folder"),
]
if not torch.cuda.is_available():
    CASES += [(name, "", NO_CUDA) for name in ("context_probe", "dcp_rank_probe", "query_merge_sweep", "spread_probe")]
    CASES += [("flex_probe", "", "expected a CUDA GPU (this script times flex_attention on one; --smoke runs")]


@pytest.mark.parametrize("script, argv, message", CASES)
def test_bad_arguments_are_refused_by_name(script, argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv.split()])
    with pytest.raises(SystemExit) as e:
        importlib.import_module(script).main()
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_jit_warm_names_its_choices():
    run = [sys.executable, os.path.join(BENCH, "jit_warm.py")]
    r = subprocess.run([*run, "mla", "bf16"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "argument dtype: invalid choice: 'bf16'" in r.stderr
    r = subprocess.run([*run, "mla", "bfloat16", "--head-dim", "64"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "expected no --head-dim with mla" in r.stderr
    if not torch.cuda.is_available():
        r = subprocess.run([*run, "gqa", "float16"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "expected a CUDA GPU (this script builds FlashInfer's CUDA kernels)" in r.stderr
