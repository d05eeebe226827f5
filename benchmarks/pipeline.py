"""The step pipeline through a real daemon on the timed sim: pipelined vs the limit and
vs a serial daemon, single-step latency vs the floor (see graphlane/bench/pipeline.py).

.venv/bin/python benchmarks/pipeline.py [--steps 60] [--depths] [--zero-cost] [--json]

--depths: the balanced, update-bound and replay-bound profiles at depth 1, 2 and 3
(how serve's default depth was chosen) instead of every profile at the default.
--zero-cost: only the zero-cost rate (4 layers, no modelled cost, 8 steps in flight).
"""

from __future__ import annotations

import argparse
import json

from graphlane.bench import pipeline as bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--depths", action="store_true", help="compare depth 1, 2, 3")
    p.add_argument("--zero-cost", action="store_true", help="only the zero-cost rate")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args()
    if args.zero_cost:
        z = bench.zero_cost()
        print(json.dumps(z, indent=2) if args.json else bench.format_zero_cost(z))
        return
    if args.depths:
        results = [
            r
            for name in ("balanced", "update-bound", "replay-bound")
            for r in bench.depths(name, steps=args.steps)
        ]
    else:
        results = bench.run(steps=args.steps)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        print(bench.table(results))


if __name__ == "__main__":
    main()
