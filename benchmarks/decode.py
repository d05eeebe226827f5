"""Decoding ahead through a daemon beside the field's in-process decode loop, on the
model program, same timed sim, one run (see graphlane/bench/decode.py): tokens/s
decoding ahead vs the modelled limit, vs the in-process loop and vs the same daemon
when the scheduler waits for each step's tokens; a lone step's latency, daemon over
in-process. Measured in alternation.

.venv/bin/python benchmarks/decode.py [--steps 60] [--reps 3] [--profile field] [--json]
"""

from __future__ import annotations

import argparse
import json

from graphlane.bench import decode as bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--profile", action="append", choices=sorted(bench.PROFILES),
                   help="a profile to run (repeatable; default: all)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args()
    names = args.profile or list(bench.PROFILES)
    results = [bench.measure(n, *bench.PROFILES[n], steps=args.steps, reps=args.reps)
               for n in names]  # fmt: skip
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        print(bench.table(results))


if __name__ == "__main__":
    main()
