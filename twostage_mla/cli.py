"""Command line: twostage-mla demo|check|bench (also python -m twostage_mla ...)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import fields

from twostage_mla.demo import DemoArgs, format_report, run_demo


def _add_dataclass_args(p: argparse.ArgumentParser, cls: type) -> None:
    for f in fields(cls):
        help_ = f.metadata.get("help", "").replace("%", "%%") + " (default: %(default)s)"
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, help=help_)


def _as_flags(message: str) -> str:
    """The demo's errors name its options as Python does (page_size): name them as flags (--page-size).
    A name followed by '=' is a field of a spec the registry quotes (page_size=64), not an option."""
    names = "|".join(f.name for f in fields(DemoArgs) if "_" in f.name)  # one-word names read as prose
    return re.sub(rf"\b({names})\b(?!=)", lambda m: "--" + m.group(1).replace("_", "-"), message)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twostage-mla", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run one DCP step on N local processes and check it against the oracle",
        description="One DCP step (mixed q_len 1..max_q_len, random data) on world_size local processes: "
        "NCCL with one GPU each where there are enough, else gloo on the CPU with the reference kernels. "
        "Checked against the float64 oracle (exit 1 past the dtype's tolerance) and timed per phase.",
    )
    _add_dataclass_args(demo, DemoArgs)
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    check = sub.add_parser(
        "check",
        help="run every backend this machine has against the float64 oracle",
        description="Every backend that serves here, on a grid of small steps (one rank), against the "
        "float64 oracle; a table of errors, exit 1 if any is past its tolerance.",
    )
    check.add_argument("--device", default="auto", help="auto (cuda if present; the default), cpu or cuda")
    check.add_argument(
        "--dtype",
        action="append",
        default=[],
        help="float32|bfloat16|float16 (or fp32, bf16, fp16), repeatable; default: bf16 and fp16 on a GPU, "
        "float32 and bf16 on the CPU",
    )
    check.add_argument("--json", action="store_true", help="print a JSON list of rows instead of the table")
    bench = sub.add_parser(
        "bench",
        help="time twostage vs onepass / expand / floor on one GPU; JSON, table, plot",
        description="Needs one CUDA GPU; onepass and expand need FlashInfer. On a CPU, use check or demo. "
        "Times each method in CUDA graphs with CUDA events (docs/performance.md says how).",
    )
    from twostage_mla.bench import add_arguments  # light: the GPU work starts in run_bench

    add_arguments(bench)
    args = parser.parse_args(argv)
    fail = {"demo": demo, "check": check, "bench": bench}[args.command].error  # usage of that command

    if args.command == "bench":
        from twostage_mla.bench import run_bench

        try:
            run_bench(args)
        except ValueError as e:
            fail(str(e))
        return 0

    if args.command == "check":
        from twostage_mla.check import HEADER, format_row, run_check

        header = [HEADER]  # printed before the first row, then gone

        def show(row: dict) -> None:  # rows as they come: a GPU backend's first layer can take ~20 s
            print(*header, format_row(row), sep="\n", flush=True)
            header.clear()

        try:  # a bad option raises before any row, so no table starts
            rows = run_check(args.device, tuple(args.dtype), on_row=None if args.json else show)
        except ValueError as e:
            fail(str(e))
        if args.json:
            print(json.dumps(rows))
        return 1 if any(r["status"].startswith("FAIL") for r in rows) else 0

    if args.command == "demo":
        opts = {f.name: getattr(args, f.name) for f in fields(DemoArgs)}
        try:
            report = run_demo(DemoArgs(**opts))
        except ValueError as e:
            fail(_as_flags(str(e)))
        print(json.dumps(report) if args.json else format_report(report))
        return 0 if report["ok"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
