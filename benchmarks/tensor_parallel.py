"""Tensor parallel on npusim's performance mode (issue 44, graphlane/bench/tensor_parallel.py):
the field bench's model program (20 layers, 185/60 us per layer) through a daemon at TP 1, 2
and 4, each collective costing HCCL's latency plus its bytes over a 910B HCCS link; tokens/s
decoding ahead and a lone step's latency, and their ratios to TP 1. The same as
``graphlane bench --tp``.

.venv/bin/python benchmarks/tensor_parallel.py [--quick] [--json]
"""

import argparse
import json

from graphlane.bench.suite import format_tp, run_tp

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    report = run_tp(quick=args.quick)
    if args.json:
        report.pop("tp_table")
        print(json.dumps(report, indent=2))
    else:
        print(format_tp(report))
