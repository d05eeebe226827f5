"""The paged program's figures (see graphlane/bench/paged.py): request bytes per
decode step at three context lengths, and pipelined paged decode through a daemon on the
timed sim against the limit and against a serial daemon.

.venv/bin/python benchmarks/paged.py [--steps 60] [--reps 3] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json

from graphlane.bench import paged as bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="steps per timed run")
    p.add_argument("--reps", type=int, default=3, help="alternating runs (the median counts)")
    p.add_argument("--quick", action="store_true", help="30 steps, 2 runs (noisier)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = p.parse_args()
    steps, reps = (30, 2) if args.quick else (args.steps, args.reps)
    r = {"request_bytes": bench.request_bytes(), "pipeline": bench.pipeline(steps, reps)}
    print(json.dumps(r, indent=2) if args.json else "\n".join(bench.format_paged(r)))


if __name__ == "__main__":
    main()
