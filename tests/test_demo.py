"""The main job end to end, as a new user runs it."""

import json
import os
import subprocess
import sys

import pytest

SMALL = ["--batch", "4", "--min-context", "100", "--max-context", "300", "--heads", "4", "--iters", "1"]


def demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "twostage_mla", "demo", *args], capture_output=True, text=True, timeout=240, env=env
    )


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_demo_json(dtype, tol):
    r = demo("--json", "--dtype", dtype, "--interleave", "4", "--combine", "ag_rs", *SMALL)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["world_size"] == 2 and report["backend"] == "reference" and report["dtype"] == dtype
    assert 0 < report["max_rel_err"] <= tol and report["ok"]
    assert set(report["phase_us"]) >= {"twostage.query_pass", "twostage.context_pass", "twostage.combine"}


def test_demo_with_the_expanded_context_pass():
    r = demo("--json", "--interleave", "2", "--context-pass", "expand", *SMALL)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["context_pass"] == "expand" and report["ok"] and 0 < report["max_rel_err"] <= 1e-5
    assert report["phase_us"]["twostage.query_pass"] == 0.0  # no query pass ran


def test_demo_runs_without_numpy(tmp_path):
    # torch does not install NumPy, so a bare `pip install twostage-mla` may have none (session 51's
    # fresh venv); a stand-in package that fails to import hides this machine's from the demo's ranks.
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\")\n")
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    assert subprocess.run([sys.executable, "-c", "import numpy"], env=env, capture_output=True).returncode != 0
    r = demo("--json", *SMALL, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"]


def test_demo_report_and_errors():
    r = demo(
        "--world-size",
        "3",
        "--heads",
        "6",
        "--batch",
        "3",
        "--min-context",
        "50",
        "--max-context",
        "90",
        "--iters",
        "1",
    )
    assert r.returncode == 0, r.stderr
    assert "max_rel_err" in r.stdout and "N=3" in r.stdout
    assert "USDT" not in r.stderr + r.stdout  # the profiler's own start / stop lines (torch 2.13) are silenced
    bad = demo("--world-size", "3", "--heads", "16")
    # Named as the flags the user typed, not as Python's field names.
    assert bad.returncode == 2 and "expected --world-size >= 1 dividing heads = 16, got --world-size = 3" in bad.stderr
    assert "usage: twostage-mla demo" in bad.stderr  # the command's usage, not the top level's


def test_demo_refuses_bad_options_before_starting_processes():
    from twostage_mla.demo import DemoArgs, run_demo

    for kwargs, match in [
        (dict(max_q_len=0), "max_q_len >= 1, got 0"),
        (dict(iters=0), "iters >= 1, got 0"),
        (dict(interleave=3), "page_size to be a multiple of interleave = 3, got 64"),
        (dict(combine="ring"), "combine in"),
        (dict(context_pass="fast"), r"context_pass in \('split', 'expand', 'auto'\), got 'fast'"),
        (dict(backend="nope"), "backend to be 'auto' or one of"),
        (dict(min_context=10, max_context=5), "min_context <= max_context"),
        (dict(heads=0), "heads >= 1, got 0"),
        (dict(max_context=10**9), r"world_size x batch x max_context \(in pages of page_size\) to fit .* \d+ GiB"),
        # a short context in huge pages: the shard's whole pages, not the context, fill the memory
        (dict(page_size=2**40, min_context=0, max_context=64), r"memory.* page_size 1099511627776\)"),
        (dict(seed=2**64 - 1), r"expected 0 <= seed < 2\*\*32, got 18446744073709551615"),
        (dict(seed=-1), r"expected 0 <= seed < 2\*\*32, got -1"),
        (dict(dtype="fp64"), r"expected dtype auto, float32, bfloat16, float16 \(or fp32, bf16, fp16\), got 'fp64'"),
        (dict(backend="flashinfer", device="cpu"), r"(?s)backend 'flashinfer' cannot serve .*device 'cpu' not in"),
    ]:
        with pytest.raises(ValueError, match=match):
            run_demo(DemoArgs(**kwargs))


def test_report_says_what_an_eager_collective_time_holds():
    from twostage_mla.demo import format_report

    r = dict(
        world_size=2,
        interleave=1,
        backend="flashinfer",
        combine="ag_rs",
        dtype="bfloat16",
        device="GPU",
        dist_backend="nccl",
        batch=2,
        heads_per_rank=8,
        context_lens=[5, 9],
        q_lens=[1, 2],
        tokens=3,
        max_abs_err=1e-3,
        max_rel_err=4e-3,
        ok=True,
        tolerance=2e-2,
        plan_ms=2.0,
        layer_ms=1.0,
        phase_us={"twostage.combine": 600.0},
    )
    assert "waiting for the other ranks" in format_report(r)
    assert "waiting" not in format_report({**r, "dist_backend": "gloo"})
    assert "4.000e-03  ok" in format_report(r)
    assert "FAIL (> 0.02)" in format_report({**r, "max_rel_err": 0.5, "ok": False})
    fused = {**r, "fused_query": True, "phase_us": {"twostage.query_pass": 0.0, "twostage.merge": 5.0}}
    assert "twostage.query_pass        (in the merge: one fused kernel)" in format_report(fused)


def test_demo_exits_1_when_the_error_is_past_the_tolerance(monkeypatch, capsys):
    from twostage_mla import cli, demo

    report = dict(ok=False, tolerance=1e-5, max_rel_err=float("nan"))
    monkeypatch.setattr(demo, "run_demo", lambda args: report)
    monkeypatch.setattr(cli, "run_demo", lambda args: report)
    assert cli.main(["demo", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False


@pytest.mark.parametrize(
    "batch,max_q_len,q_lens",
    [(1, 8, [8]), (2, 8, [1, 8]), (3, 8, [1, 4, 8]), (8, 8, [1, 2, 3, 4, 5, 6, 7, 8]), (5, 2, [1, 2, 1, 2, 1])],
)
def test_demo_step_always_has_the_longest_request(batch, max_q_len, q_lens):
    from twostage_mla.demo import DemoArgs, _step_shape

    ctx, ql = _step_shape(DemoArgs(batch=batch, max_q_len=max_q_len))
    assert ql == q_lens and len(ctx) == batch


def test_demo_help_describes_every_option():
    r = subprocess.run(
        [sys.executable, "-m", "twostage_mla", "demo", "--help"],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "250"},  # one line per option
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "token p on rank (p // I) % N" in r.stdout and "(default: a2a)" in r.stdout


def test_the_command_line_names_the_demos_options_as_flags(capsys):
    # Its own options as flags; the registry's quoted spec (page_size=64) as it is.
    from twostage_mla import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--max-q-len", "0"])
    assert e.value.code == 2 and "expected --max-q-len >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["demo", "--backend", "flashinfer", "--device", "cpu"])
    err = capsys.readouterr().err
    assert "backend 'flashinfer' cannot serve" in err and " page_size=64 " in err and "--page-size=" not in err
