"""The command line of a benchmark measured per cost profile (benchmarks/inprocess.py,
benchmarks/decode.py): ``--steps``, ``--reps``, ``--profile`` (repeatable), ``--json``.

The module given has ``PROFILES`` (name -> (patch_us, task_us)), ``measure(name,
patch_us, task_us, steps=, reps=)`` returning figures with ``as_dict()``, and
``table(results)``."""

from __future__ import annotations

import argparse
import json
from types import ModuleType


def run_profiles(bench: ModuleType, doc: str | None) -> None:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
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
