"""Issue 44's measurement (``graphlane bench --tp``): daemons at TP 1 and 2 on npusim's
perf mode with HCCL's modelled cost, at a tiny step count. It runs and reports the same
keys for every TP size; nothing here asserts a rate or a wall time."""

from __future__ import annotations

import pytest

from graphlane.bench import tensor_parallel as tp
from graphlane.cli import _parser


def test_the_daemons_sim_models_tp_n_as_the_bench_says() -> None:
    """A rank's tasks cost 1/N of TP 1's, its updates the same, each collective HCCL's
    latency plus its bytes over an HCCS link."""
    s1, s2 = tp.sim_settings(1, 3.0), tp.sim_settings(2, 3.0)
    assert s1["mode"] == s2["mode"] == "perf"
    assert (s1["task_us"], s2["task_us"]) == (3.0, 1.5)
    assert s1["patch_us"] == s2["patch_us"] == 185.0
    assert s2["collective_us"] == tp.HCCL_LATENCY_US
    assert s2["collective_gb_s"] == tp.HCCS_LINK_GB_S
    assert tp.program_table(2)["tensor_parallel"] == "2"
    # update-bound at every N: 185 us per layer is longer than 60/N us plus two latencies
    assert tp.limit_steps_s(1) == tp.limit_steps_s(2) == tp.limit_steps_s(4)


def test_bench_tp_runs_daemons_at_tp_1_and_2_and_reports_consistent_keys() -> None:
    f = tp.measure(tp_sizes=(1, 2), steps=4, reps=1, lone_steps=2, layers=2)
    d = f.as_dict()
    assert set(d["tokens_s"]) == set(d["lone_ms"]) == set(d["limit_tokens_s"]) == {"1", "2"}
    assert all(len(v) == 1 and v[0] > 0 for v in d["tokens_s"].values())
    assert all(len(v) == 1 and v[0] > 0 for v in d["lone_ms"].values())
    for n in ("1", "2"):
        for what in ("tokens/s vs TP 1", "lone step vs TP 1", "tokens/s vs limit"):
            assert f"TP {n}: {what}" in d["ratios"]
    assert d["ratios"]["TP 1: tokens/s vs TP 1"] == 1.0
    assert (d["collective_us"], d["collective_gb_s"]) == (tp.HCCL_LATENCY_US, tp.HCCS_LINK_GB_S)
    assert set(d["excess_ms_per_collective"]) == {"2"}
    text = tp.table(f)
    assert "tokens/s ahead" in text and "lone step ms" in text and "load average" in text


def test_bench_runs_the_tp_part_alone_with_a_flag() -> None:
    args = _parser().parse_args(["bench", "--tp", "--quick"])
    assert args.tp and args.quick


def test_steps_beyond_the_sequences_room_are_refused() -> None:
    with pytest.raises(ValueError, match="steps must be in"):
        tp.measure(steps=10_000)
