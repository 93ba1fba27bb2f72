import pytest
import torch

from twostage_mla.check import format_row, run_check, verdict
from twostage_mla.cli import main


def test_check_runs_reference_and_skips_with_reasons(capsys):
    rows = run_check("cpu")
    ran = [r for r in rows if "max_rel_err" in r]
    assert {r["backend"] for r in ran} == {"reference"}
    assert all(r["status"] == "ok" for r in ran) and len(ran) == 4  # 2 shapes x 2 dtypes
    assert all(r["status"].startswith("skipped: ") for r in rows if r not in ran)
    assert all("reference" in format_row(r) for r in rows if r["backend"] == "reference")
    assert main(["check", "--device", "cpu", "--dtype", "fp32"]) == 0
    assert "ok" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse's error: exit 2 with the message
        main(["check", "--device", "cpu", "--dtype", "float64"])
    assert "expected --dtype in" in capsys.readouterr().err


def test_a_dtype_given_twice_runs_once():
    assert run_check("cpu", ("fp32", "float32")) == run_check("cpu", ("fp32",))


def test_check_hands_over_each_row_as_it_comes():
    seen = []
    rows = run_check("cpu", ("fp32",), on_row=seen.append)
    assert seen == rows and len(rows) > 2


def test_check_refuses_a_bad_device():
    with pytest.raises(ValueError, match="expected --device auto, cpu or cuda, got 'gpu'"):
        run_check("gpu")


def test_verdict_fails_past_the_tolerance_and_on_nan():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5, 2, 8, generator=g, dtype=torch.float64)
    assert verdict(ref.float(), ref, torch.float32)[2]
    _, rel, ok = verdict(ref * (1 + 1e-4), ref, torch.float32)  # 10x float32's 1e-5
    assert not ok and rel == pytest.approx(1e-4, rel=1e-3)
    assert verdict(ref * (1 + 1e-4), ref, torch.bfloat16)[2]
    nan = ref.clone()
    nan[0, 0, 0] = float("nan")
    assert not verdict(nan, ref, torch.bfloat16)[2]


def test_check_command_exits_1_on_a_failed_row(monkeypatch):
    from twostage_mla import check

    rows = [dict(backend="reference", shape="mla", dtype="float32", max_rel_err=1.0, status="FAIL (> 1e-05)")]
    monkeypatch.setattr(check, "run_check", lambda *a, **k: rows)
    assert main(["check", "--device", "cpu", "--json"]) == 1
