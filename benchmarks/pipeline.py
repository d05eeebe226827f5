"""Step pipeline on the timed sim: serial vs pipelined vs the limit, latency vs the floor.

.venv/bin/python benchmarks/pipeline.py [--layers 8] [--steps 40] [--json]
"""

from __future__ import annotations

import argparse
import json

from graphlane.tools import bench_pipeline as bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args()
    results = bench.run(layers=args.layers, steps=args.steps)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        print(bench.table(results))


if __name__ == "__main__":
    main()
