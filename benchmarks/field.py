"""The field's costs on npusim's performance mode (issue 42, graphlane/bench/field.py):
the model program at 20 layers and 185/60 us per layer, a scheduler's work of 0, 0.5
and 2 ms per step, decoding ahead through a daemon beside the vllm-ascend loop (async
scheduling, one thread) and the same with the updates on a thread of their own; a lone
step; graphlane's own CPU per step; the null round trip against raw pyzmq. Goals PASS or
FAIL. The same as ``graphlane bench --field``.

.venv/bin/python benchmarks/field.py [--quick] [--json]
"""

import argparse
import json
import sys

from graphlane.bench.goals import exit_status, goals
from graphlane.bench.suite import format_field, run_field

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    report = run_field(quick=args.quick)
    verdicts = goals(report)
    if args.json:
        report["goals"] = verdicts
        report.pop("field_table")
        print(json.dumps(report, indent=2))
    else:
        print(format_field(report))
    sys.exit(exit_status(verdicts))
