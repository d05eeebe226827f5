"""The in-process worker figure of `graphlane bench` measures answered steps."""

from __future__ import annotations

from graphlane.bench.worker import per_step_us


def test_the_worker_figure_answers_every_bundled_step() -> None:
    out = per_step_us(bundles=40, blocks=2)  # raises if a step went unanswered
    assert out["bundle"] == 16
    assert len(out["blocks_us"]) == 2
    assert all(t > 0 for t in out["blocks_us"])
