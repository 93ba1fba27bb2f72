"""The cost model of docs/cost_model.md, and a gloo smoke run of benchmarks/prefill_cost.py."""

from __future__ import annotations

import json

import prefill_cost as pc
import pytest

D, DV, E = 576, 512, 2  # DeepSeek-V3 latent widths, bf16


@pytest.mark.parametrize(
    "n, h, t, c, gather_mb, split_mb",
    [
        (2, 32, 128, 1 << 20, 603.98, 4.46),  # the worked numbers of docs/cost_model.md
        (8, 128, 128, 1 << 20, 1056.96, 31.25),
        (2, 32, 512, 131072, 75.50, 17.86),
        (2, 32, 8192, 32768, 18.87, 285.74),
        (8, 128, 8192, 131072, 132.12, 2000.16),
    ],
)
def test_predicted_bytes_worked_numbers(n, h, t, c, gather_mb, split_mb):
    b = pc.predicted_bytes(n, t, h, c, D, DV, E)
    assert b["gather_kv"] / 1e6 == pytest.approx(gather_mb, abs=0.01)
    assert b["split_a2a"] / 1e6 == pytest.approx(split_mb, abs=0.01)


def test_crossover_is_1_89_heads():
    # split_a2a == gather_kv exactly at C / T = H * (D*e + Dv*e + 4) / (D*e)
    h, t = 32, 100
    c = h * t * (D * E + DV * E + 4) / (D * E)
    b = pc.predicted_bytes(2, t, h, c, D, DV, E)
    assert b["gather_kv"] == pytest.approx(b["split_a2a"])
    assert c / t / h == pytest.approx(1.892, abs=1e-3)


def test_benchmark_runs_on_gloo(tmp_path):
    out = tmp_path / "new_folder" / "res.json"  # made by the script
    argv = "--device cpu --tokens 4 --contexts 512 8192 --heads-per-rank 2 --kv-lora-rank 32 --rope-dim 16"
    argv = argv.split() + ["--iters", "2", "--warmup", "1", "--out", str(out)]
    assert pc.main(argv) == 0
    res = json.loads(out.read_text())
    assert len(res["rows"]) == 2 and res["env"]["dist_backend"] == "gloo"
    for r in res["rows"]:
        assert all(v > 0 for v in r["ms"].values())
        # (N-1)/N * T * H * (D*e + Dv*e + 4), N = 2, T = 4, H = 2*2, D = 48, Dv = 32, bf16
        assert r["predicted_bytes"]["split_a2a"] == pytest.approx(0.5 * 4 * 4 * (48 * 2 + 32 * 2 + 4))


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--world-size 1", "expected --world-size >= 2 (a group to move bytes across), got 1"),
        ("--tokens 4 0", "expected --tokens >= 1, got 0"),
        ("--heads-per-rank -2", "expected --heads-per-rank >= 1, got -2"),
        ("--iters 0", "expected --iters >= 1, got 0"),
        ("--warmup -1", "expected --warmup >= 0, got -1"),
        ("--rope-dim -1", "expected --rope-dim >= 0, got -1"),
        ("--max-gib 0", "expected --max-gib > 0, got 0.0"),
        ("--dtype bf16", "argument --dtype: invalid choice: 'bf16'"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    # before any process starts: N = 1 once ran to a ZeroDivisionError inside the rank (H200, session 16)
    with pytest.raises(SystemExit) as e:
        pc.main(["--device", "cpu", *argv.split()])
    assert e.value.code == 2 and message in capsys.readouterr().err
