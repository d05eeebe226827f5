"""The paged figures of ``graphlane bench``: a paged decode step's request does not grow
with the context (the attention step carrying the KV does), and the issue's goals for
pipelined paged decode are judged when the figures are there."""

from __future__ import annotations

from graphlane.bench.goals import goals
from graphlane.bench.paged import request_bytes


def test_paged_request_bytes_do_not_grow_with_the_context() -> None:
    rows = request_bytes((128, 1024, 4096))
    paged = [r["paged_bytes"] for r in rows]
    dense = [r["attention_bytes"] for r in rows]
    assert max(paged) - min(paged) <= 16, paged  # msgpack ints of the lengths only
    assert max(paged) < 20_000
    assert dense[2] > 30 * dense[0] / 2 and dense[0] > 50 * paged[0], dense


def test_paged_goals_are_judged() -> None:
    report = {"paged": {"pipeline": {"pipelined_vs_limit": 0.4, "pipelined_vs_serial": 1.9}}}
    met = {g["goal"]: g["met"] for g in goals(report)}
    assert met == {"paged decode vs limit": False, "paged decode vs serial": True}
