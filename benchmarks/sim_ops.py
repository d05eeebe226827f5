"""The simulated NPU's own cost per op, beside the CPU eager op each stands for.

.venv/bin/python benchmarks/sim_ops.py [--layers 4] [-n 200] [--repeats 5] [--json]
(the same as ``python -m npusim.bench``: the benchmark is the simulator's own)
"""

from __future__ import annotations

from npusim import bench as bench_sim

if __name__ == "__main__":
    bench_sim.main()
