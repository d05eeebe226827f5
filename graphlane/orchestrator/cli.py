"""The ``graphlane`` command line."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphlane",
        description="Keep captured NPU graphs hot and patch their parameters between replays.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ex = sub.add_parser(
        "example",
        help="capture, patch and replay a layered attention graph on the simulated NPU",
        description="Capture a decode-attention graph once on the simulated NPU, then patch "
        "its sequence lengths between replays and check each result against eager compute.",
    )
    ex.add_argument("--steps", type=int, default=8, help="steps to run (default 8)")
    ex.add_argument("--layers", type=int, default=4, help="attention layers (default 4)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "example":
        from graphlane.workers.sim.example import run

        return run(steps=args.steps, layers=args.layers)
    return 2


if __name__ == "__main__":
    sys.exit(main())
