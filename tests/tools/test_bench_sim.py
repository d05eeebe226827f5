"""The sim's own benchmark runs and reports every figure (timing is never asserted)."""

from __future__ import annotations

import math

from npusim import bench as bench_sim
from npusim import configure


def test_bench_sim_returns_every_figure_and_restores_the_config() -> None:
    before = configure()
    result = bench_sim.run(layers=2, n=4, repeats=1, step_n=3)
    assert configure() == before
    names = set(result["figures"])
    assert names == {
        "inplace add_", "h2d copy_", "to(npu)", "to(cpu)", "patch", "replay 2 layers",
        "replay 2 layers, timed 0us", "step 2 layers, timed 0us", "event record+wait",
        "ext event record+wait+sync",
    }  # fmt: skip
    for fig in result["figures"].values():
        assert fig["sim_us"] > 0 and fig["sim_cpu_us"] >= 0 and fig["cpu_us"] > 0
        assert math.isfinite(fig["ratio"])
    text = bench_sim.table(result)
    assert all(name in text for name in names)
