"""The benchmark's reporting (table, targets, plot) on made-up records; the timing itself needs a GPU."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from twostage_mla import bench


def _records() -> list[dict]:
    meta = dict(gpu="X", N=1, graph=True)
    out = [dict(meta, method="copy", backend=None, B=None, C=None, Q=None, heads=None, time_us=None, gbps=4000.0)]
    for c, one, ctx in ((8192, 100.0, 88.0), (32768, 300.0, 280.0)):
        for h in (16, 128):
            kv = 32 * c * 576 * 2
            base = dict(meta, B=32, C=c, Q=4, heads=h, kv_bytes=kv)
            out += [
                dict(base, method="floor", backend=None, time_us=kv / 4e15 * 1e6),
                dict(base, method="onepass", backend="flashinfer", time_us=one),
                dict(base, method="expand", backend="flashinfer", time_us=3 * one),
                dict(
                    base,
                    method="twostage",
                    backend="flashinfer",
                    time_us=ctx + 8,
                    context_us=ctx,
                    overhead_us=8.0,
                    rest_alone_us=6.5,
                    context_gbps=kv / (ctx * 1e-6) / 1e9,
                ),
            ]
    return out


def test_table_and_targets():
    recs = _records()
    table = bench.format_table(recs)
    assert "onepass" in table and "flashinfer" in table and len(table.splitlines()) == 2 + 4
    # methods not run (--methods twostage) read "-", never NaN
    only = [r for r in recs if r["method"] in ("copy", "twostage")]
    assert "nan" not in bench.format_table(only) and " - " in bench.format_table(only).splitlines()[2]
    report = bench.check_targets(recs)
    assert "twostage/onepass B=32 Q=4 H=16 C=8192: 0.960 (<= 1.00) PASS" in report
    assert "expand/twostage B=32 Q=4 H=16 C=32768" in report
    # the ratios the right way round, each context length against its own limit
    assert "twostage/onepass B=32 Q=4 H=16 C=32768: 0.960 (<= 1.03) PASS" in report
    assert re.search(r"expand/twostage B=32 Q=4 H=16 C=8192: 3\.1\dx \(>= 2x\) PASS", report), report
    row = next(r for r in table.splitlines() if r.split()[:4] == ["32", "8192", "4", "16"])
    assert row.rstrip().endswith("0.960"), row
    assert "overhead B=32 Q=4 H=16 C=8192: 8.0 us = query pass fused in the merge; that kernel alone: 6.5 us" in report
    # an expanded point is marked in the table, with the legend below it
    recs[-1]["context_pass"] = "expand"
    marked = bench.format_table(recs).splitlines()
    assert marked[-1].startswith("* the expanded context pass") and sum("*" in line for line in marked) == 2


def test_an_expanded_point_is_checked_against_expand_within_timing_noise():
    recs = _records()
    for r in recs:  # the 128-head points at 8K: the expanded pass, 0.1 % / 1 % slower than expand's own call
        if r["method"] in ("twostage", "expand") and (r["heads"], r["C"]) == (128, 8192):
            r["time_us"], r["context_pass"] = (300.3 if r["method"] == "twostage" else 300.0), "expand"
    recs += [dict(r, C=32768, time_us=303.0 if r["method"] == "twostage" else 300.0) for r in recs
             if r.get("context_pass") == "expand"]  # fmt: skip
    report = bench.check_targets(recs)
    assert ("expand/twostage B=32 Q=4 H=128 C=8192: 1.00x (>= 1x 0.9990x, the same kernel as expand: equal within "
            "0.5 %) PASS") in report, report
    assert re.search(r"expand/twostage B=32 Q=4 H=128 C=32768: 0\.99x .* MISS", report), report
    # with expand's twin (the same call planned again) timed, the report shows both gaps of the same work
    tw = next(r for r in recs if r["method"] == "expand" and (r["heads"], r["C"]) == (128, 8192))
    recs.append(dict(tw, method="expand_twin", time_us=297.0))
    report = bench.check_targets(recs)
    assert ("0.9990x, the same kernel as expand: equal within 0.5 %; same work, timed apart: expand/twin 1.0101x, "
            "expand/context pass alone") in report, report


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "b.png"
    assert bench.plot_records(_records(), str(path)) and path.stat().st_size > 1000


def test_grid_arguments():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    a = p.parse_args(["--context", "1K,8k,32768", "--quick"])
    assert a.context == [1024, 8192, 32768] and a.quick and a.batch is None
    with pytest.raises(argparse.ArgumentTypeError, match=r"whole numbers, each maybe with K .* got '1M'"):
        bench._ints("1M")


def test_bad_options_are_refused_by_name():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    for argv, match in (
        (["--methods", "twostag"], r"--methods a comma list of twostage, onepass, expand, floor, got 'twostag'"),
        (["--backends", "flashinfr"], r"--backends 'all' or a comma list of .*got \['flashinfr'\]"),
        (["--batch", "0,8"], r"--batch values >= 1, got \[0, 8\]"),
        (["--heads", "16,-1"], r"--heads values >= 1"),
        (["--page-size", "0"], r"--page-size >= 1, got 0"),
        (["--rope-dim", "-1"], r"--rope-dim >= 0, got -1"),
        (["--slow-ms", "0"], r"--slow-ms > 0, got 0.0"),
        (["--budget-s", "-1"], r"--budget-s > 0, got -1.0"),
        (["--backends", ", ,"], r"--backends 'all' or a comma list of .*got ', ,'"),
    ):
        with pytest.raises(ValueError, match=match):
            bench.run_bench(p.parse_args(argv))


def test_an_out_that_cannot_be_written_is_refused_before_any_timing(tmp_path):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    (tmp_path / "a_file").write_text("")
    msg = r"expected --out in a folder this user can make or write, got '.*a_file/x.json' \(.*a_file is not"
    with pytest.raises(ValueError, match=msg):
        bench.run_bench(p.parse_args(["--out", str(tmp_path / "a_file" / "x.json")]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_grid_past_the_gpus_memory_is_refused_before_any_timing(tmp_path):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    argv = ["--batch", "64", "--context", "100000000K", "--out", str(tmp_path / "x.json")]
    with pytest.raises(ValueError, match=r"largest grid point's KV cache to fit the GPU's free memory: B = 64"):
        bench.run_bench(p.parse_args(argv))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_bench_without_a_gpu_points_to_check_and_demo():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    with pytest.raises(ValueError, match=r"expected a CUDA GPU for bench .*'twostage-mla check' and '.* demo'"):
        bench.run_bench(p.parse_args([]))
