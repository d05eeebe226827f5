"""Control plane against a raw pyzmq+msgpack baseline, and scaling over devices.

    .venv/bin/python benchmarks/control_plane.py [--json]

The same figures are part of `graphlane bench`.
"""

from __future__ import annotations

import argparse
import json

from graphlane.bench import control_plane as bench
from graphlane.bench import worker as bench_worker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    report = {
        "control_plane": bench.control_plane(),
        "bandwidth": bench.bandwidth(),
        "worker_in_process": bench_worker.per_step_us(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        sections = {
            "control plane, null device": report["control_plane"]["null"],
            "control plane, timed sim": report["control_plane"]["sim"],
            "tensor bandwidth, null device": report["bandwidth"]["null"],
            "tensor bandwidth, timed sim": report["bandwidth"]["sim"],
            "worker CPU per bundled step (us), in-process, null device": {
                "per_step_us": report["worker_in_process"]["per_step_us"]
            },
        }
        for section, figures in sections.items():
            print(section)
            for k, v in figures.items():
                print(f"  {k:<26} {v:.3f}" if isinstance(v, float) else f"  {k:<26} {v}")


if __name__ == "__main__":
    main()
