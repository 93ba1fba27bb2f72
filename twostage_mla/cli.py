"""Command line: ``twostage-mla demo`` (and ``python -m twostage_mla demo``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from twostage_mla.demo import DemoArgs, format_report, run_demo


def _add_dataclass_args(p: argparse.ArgumentParser, cls: type) -> None:
    for f in fields(cls):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twostage-mla", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run one DCP step on N local processes and check it against the oracle")
    _add_dataclass_args(demo, DemoArgs)
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    args = parser.parse_args(argv)

    if args.command == "demo":
        opts = {f.name: getattr(args, f.name) for f in fields(DemoArgs)}
        try:
            report = run_demo(DemoArgs(**opts))
        except ValueError as e:
            parser.error(str(e))
        print(json.dumps(report) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
