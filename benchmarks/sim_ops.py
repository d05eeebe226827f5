"""The simulated NPU's own cost per op, beside the CPU eager op each stands for.

.venv/bin/python benchmarks/sim_ops.py [--layers 4] [-n 200] [--repeats 5] [--json]
(the same as ``python -m npusim.bench``: the benchmark is the simulator's own, run
through its documented command line, not its module's insides)
"""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    sys.argv[0] = "npusim.bench"
    runpy.run_module("npusim.bench", run_name="__main__", alter_sys=True)
