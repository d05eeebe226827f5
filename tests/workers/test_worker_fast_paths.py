"""The step path's shortcuts agree with the general code they stand for."""

from __future__ import annotations

import random

import pytest

from graphlane.workers.backends import create_backend
from graphlane.workers.metrics import PENDING_MAX, WorkerMetrics
from graphlane.workers.programs import AttentionConfig, AttentionProgram, StepError


def test_batched_step_metrics_snapshot_as_single_observations() -> None:
    rng = random.Random(5)
    batched, single = WorkerMetrics(), WorkerMetrics()
    for i in range(PENDING_MAX + 37):
        program, op = ("a", "step") if i % 3 else ("b", "update")
        held, dispatch = rng.random() * 1e-3, rng.choice([0.0, rng.random() * 1e-4])
        replay_at = rng.choice([0.0, 10.0])
        done_at = replay_at + rng.random() * 1e-3 - 2e-4  # may end "before" its replay
        batched.observe_done(program, op, held, dispatch, replay_at, done_at)
        single.observe_step(program, op, held)
        if dispatch:
            single.dispatch_seconds.observe(dispatch)
        if replay_at:
            single.replay_seconds.observe(max(0.0, done_at - replay_at))
    fast, slow = batched.snapshot(), single.snapshot()
    for got, want in [
        *zip(fast["step_seconds"], slow["step_seconds"], strict=True),
        (fast["dispatch_seconds"], slow["dispatch_seconds"]),
        (fast["replay_seconds"], slow["replay_seconds"]),
    ]:
        assert got["sum"] == pytest.approx(want["sum"], rel=1e-12)  # summed in other groups
        assert {**got, "sum": 0} == {**want, "sum": 0}
    assert {**fast, "step_seconds": 0, "dispatch_seconds": 0, "replay_seconds": 0} == {
        **slow, "step_seconds": 0, "dispatch_seconds": 0, "replay_seconds": 0
    }


def test_attention_group_call_is_its_arguments_with_the_steps_lengths() -> None:
    program = AttentionProgram(AttentionConfig(layers=2, max_kv_len=16, buckets=(2, 4)))
    backend = create_backend("null", 0)
    buffers = program.allocate(backend, 4)
    for lengths in ([3, 5], [1, 2, 3, 4], [16, 1, 1]):
        plan = program.plan(len(lengths), {"actual_seq_lengths_kv": lengths}, {})
        for group in range(2):
            op, args, kwargs = program.group_call(buffers, plan, group)
            assert op == "npu_fused_infer_attention_score.out" and args == ()
            expected = program._arguments(buffers, group, list(plan.values["lengths"]))
            assert kwargs == expected and list(kwargs) == list(expected)
            again = program.group_call(buffers, plan, group)[2]
            assert again is not kwargs and again["out"] is not kwargs["out"]


@pytest.mark.parametrize("batch", [0, -1, 5, True, 2.0, "2"])
def test_attention_plan_refuses_batches_as_bucket_for_does(batch: object) -> None:
    program = AttentionProgram(AttentionConfig(layers=1, max_kv_len=8, buckets=(2, 4)))
    with pytest.raises(StepError) as planned:
        program.plan(batch, {"actual_seq_lengths_kv": [1]}, {})  # type: ignore[arg-type]
    with pytest.raises(StepError) as direct:
        program.bucket_for(batch)  # type: ignore[arg-type]
    assert str(planned.value) == str(direct.value)


def test_attention_plan_pads_to_the_bucket() -> None:
    program = AttentionProgram(AttentionConfig(layers=1, max_kv_len=8, buckets=(2, 4)))
    plan = program.plan(3, {"actual_seq_lengths_kv": [1, 2, 3]}, {})
    assert plan.bucket == 4 and plan.values["lengths"] == (1, 2, 3, 1) and dict(plan.inputs) == {}
    full = program.plan(2, {"actual_seq_lengths_kv": [7, 8]}, {})
    assert full.bucket == 2 and full.values["lengths"] == (7, 8)
