"""The model decode benchmark's pieces (graphlane/bench/decode.py): the field's
in-process loop and a daemon, waiting for each step's tokens or decoding ahead, give the
same greedy tokens for the same prompts (the three ways time the same work); the floor
of a lone step follows the graph's stretches; the issue's goals are judged per profile."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from graphlane.bench import decode
from graphlane.bench.goals import goals

STEPS = 6


@pytest.mark.usefixtures("float32_attention")  # the bench's float32 model, in this process
def test_in_process_and_daemon_decode_the_same_tokens(start_daemon: Any) -> None:
    d = start_daemon(devices=1, programs=[decode.program_config()])
    local = decode.generate_in_process(STEPS)
    ahead = asyncio.run(decode.generate_through_daemon(d.endpoint, STEPS, ahead=True))
    waiting = asyncio.run(decode.generate_through_daemon(d.endpoint, STEPS, ahead=False))
    assert len(local) == decode.BATCH * (STEPS + 1)
    assert ahead == local
    assert waiting == local


def test_the_lone_floor_waits_for_each_layers_update() -> None:
    # 2 tasks before layer 0's wait, 3 between waits, 5 after the last one; 1 us each.
    stretches = [2, 3, 3, 5]
    # update-bound: layer l's stretch starts at (l + 1) * 10 us; the last ends 5 us later
    assert abs(decode.lone_floor(10.0, 1.0, stretches) - 35e-6) < 1e-12
    # replay-bound: the device never waits (every release is there in time)
    assert abs(decode.lone_floor(0.5, 1.0, stretches) - 13e-6) < 1e-12


def test_decode_goals_are_judged_per_profile() -> None:
    row = {"profile": "field", "ahead_vs_limit": 0.96, "ahead_vs_inprocess": 0.9,
           "ahead_vs_waiting": 1.4, "latency_vs_inprocess": 1.3}  # fmt: skip
    met = {g["goal"]: g["met"] for g in goals({"decode": [row]})}
    assert met == {
        "model field decoding ahead vs limit": True,
        "model field decoding ahead vs in-process": False,
        "model field decoding ahead vs waiting": True,
        "model field lone step vs in-process": False,
    }
