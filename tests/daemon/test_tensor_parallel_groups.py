"""Tensor-parallel groups through a real daemon (issue 44: one step, one group): two
devices, one group; clients reach its leader only; every rank replays every step (the
test program's graph all-reduces its output, so a step's answer is twice one device's,
and a rank that skipped it would leave the collective unmet); a rank's death restarts
the group, whose sequences then get STATE_LOST; status and metrics show each rank."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from daemons import SHARED_PIDS, RunningDaemon, finish, free_port, launch, pid_alive, wait_for
from reference import decode_stack

from graphlane import GraphlaneError
from graphlane.client import Client
from graphlane.protocol import ops, wire

WORKERS_TESTS = str(Path(__file__).parents[1] / "workers")  # allreduce_program
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [WORKERS_TESTS, os.environ.get("PYTHONPATH")]))}
LAYERS, HEADS, KV_HEADS, DIM, KV = 2, 2, 1, 16, 8
ALLREDUCE = {"name": "allreduce_program:AllReduceAttention", "tensor_parallel": 2,
             "layers": LAYERS, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": DIM,
             "max_kv_len": KV, "buckets": [1, 2], "dtype": "float32"}  # fmt: skip
#: A stateful program served whole on each rank: its sequences' add, decode, append and
#: free reach every rank through the leader, in order.
MODEL = {"name": "model", "block_size": 128, "num_blocks": 4, "max_blocks_per_seq": 3,
         "buckets": [1], "prefill_chunk": 16, "dtype": "float32",
         "random": {"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                    "intermediate_size": 64, "num_hidden_layers": 1,
                    "num_attention_heads": 2, "num_key_value_heads": 1}}  # fmt: skip


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """One group of 2 for the module (its start costs two workers' capture): the first
    test leaves it as it found it, the second restarts it."""
    # (idle_spin_us set: "auto" polls on no 2-core host serving two workers)
    d = launch(tmp_path_factory.mktemp("tp"), "group", devices=2, env=ENV,
               programs=[ALLREDUCE, MODEL], metrics_port=free_port(),
               idle_spin_us=1000)  # fmt: skip
    SHARED_PIDS.add(d.proc.pid)  # outlives each test, not a test's leak
    try:
        yield d
    finally:
        SHARED_PIDS.discard(d.proc.pid)
        finish(d)


def _inputs(seed: int, batch: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "query": torch.randn(batch, HEADS, 1, DIM, generator=g),
        "key": torch.randn(LAYERS, batch, KV_HEADS, KV, DIM, generator=g),
        "value": torch.randn(LAYERS, batch, KV_HEADS, KV, DIM, generator=g),
    }


def _expected(inputs: dict[str, torch.Tensor], lengths: list[int]) -> torch.Tensor:
    one = decode_stack(inputs["query"], list(inputs["key"]), list(inputs["value"]), lengths)
    return 2 * one  # the all-reduce of two ranks' equal outputs


def test_a_group_serves_each_step_on_every_rank_with_one_reply(group: RunningDaemon) -> None:
    d = group

    async def main() -> dict[str, Any]:
        async with Client(d.endpoint, timeout=60) as c:
            hello = await c.hello()
            for i in range(4):
                x = _inputs(i, batch=1 + i % 2)
                lengths = [KV - i, 3][: 1 + i % 2]
                r = await c.step("allreduce", 0, {"actual_seq_lengths_kv": lengths}, x)
                torch.testing.assert_close(r.outputs["out"], _expected(x, lengths))
            # the group's sequences: added, appended, decoded and freed on both ranks (a
            # rank that missed the free would refuse the second add of 5, and leave)
            for prompt in ([1, 2, 3], [7, 8]):
                await c.add_sequence("model", 0, 5, prompt, [0])
                assert (await c.append_blocks("model", 0, 5, [1]))["blocks"] == 2
                for n in range(4):
                    await c.decode("model", 0, [5], new_blocks={5: [2]} if n == 2 else None)
                assert (await c.free_sequences("model", 0, [5]))["freed"] == [5]
            with_bad_device = c.step("allreduce", 1, {"actual_seq_lengths_kv": [1]}, _inputs(9))
            try:
                await with_bad_device
            except GraphlaneError as exc:  # the follower is no endpoint of the client's
                assert exc.code == "UNKNOWN_DEVICE", exc
            else:
                raise AssertionError("device 1 (a follower) served a step")
            return hello

    hello = asyncio.run(main())
    (leader,) = hello["workers"]  # one endpoint per group: its leader's
    assert leader["device"] == 0 and leader["group"]["devices"] == [0, 1]
    steps = 4 + 2 * (1 + 4)  # each device request ran once on each rank

    def every_step_reported() -> list[dict[str, Any]] | None:
        ws = d.status()["workers"]
        return ws if all(w["steps"] == steps for w in ws) else None

    ranks = wait_for(every_step_reported, 30, "both ranks to report every step")
    assert [(w["device"], w["group"]["rank"], w["group"]["behind"]) for w in ranks] == [
        (0, 0, 0), (1, 1, 0)
    ]  # fmt: skip
    assert [w["restarts"] for w in ranks] == [0, 0]  # no rank left the leader's plan
    # A rank that falls behind shows: rank 1 stopped, the leader decodes on (the model
    # program runs whole on each rank, no collective waits for rank 1).
    os.kill(ranks[1]["pid"], signal.SIGSTOP)
    try:

        async def decode_alone() -> None:
            async with Client(d.endpoint, timeout=60) as c:
                await c.add_sequence("model", 0, 6, [1, 2], [0])
                for _ in range(3):
                    await c.decode("model", 0, [6])

        asyncio.run(decode_alone())
        lagging = wait_for(
            lambda: (w := d.status()["workers"][1])["group"]["behind"] >= 4 and w, 30,
            "rank 1's lag to show",
        )  # fmt: skip
        assert lagging["steps"] == steps
    finally:
        os.kill(ranks[1]["pid"], signal.SIGCONT)
    steps += 4
    wait_for(every_step_reported, 30, "rank 1 to catch up")
    # Rank 1's own socket answers hello and status, and refuses a step naming the leader.
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ranks[1]["endpoint"])
    try:
        step = ops.Step("allreduce", 1, {"actual_seq_lengths_kv": [1]}, outputs=["out"])
        sock.send_multipart(wire.encode_request(1, "step", step))
        assert sock.poll(30_000), "rank 1 did not answer"
        (reply,) = wire.decode_replies(sock.recv_multipart())
        assert isinstance(reply, wire.Reply) and reply.error is not None
        assert reply.error.code == "BAD_REQUEST" and "leader, device 0" in str(reply.error)
        # The leader polls while idle; rank 1 never does: its work comes from its group
        # thread, which needs the interpreter lock a poll holds.
        sock.send_multipart(wire.encode_request(2, "status", ops.Status()))
        assert sock.poll(30_000), "rank 1 did not answer"
        (reply,) = wire.decode_replies(sock.recv_multipart())
        assert isinstance(reply, wire.Reply) and reply.error is None
        assert reply.body(ops.OPS["status"])["metrics"]["spin_seconds"] == 0.0

        async def leader_spin() -> float:
            async with Client(d.endpoint, timeout=60) as c:
                return float((await c.worker_status(0))["metrics"]["spin_seconds"])

        assert asyncio.run(leader_spin()) > 0
    finally:
        sock.close(0)
        ctx.destroy(linger=0)
    out = subprocess.run([sys.executable, "-m", "graphlane", "status", "--connect", d.endpoint],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "group 0 rank 1 of 2 (devices [0, 1], leader 0)" in out.stdout, out.stdout
    assert "behind the leader 0" in out.stdout


def test_killing_a_rank_restarts_the_group_and_its_sequences_are_lost(
    group: RunningDaemon,
) -> None:
    d = group
    before = {w["device"]: w for w in d.status()["workers"]}

    def kill_rank_1() -> dict[int, Any]:
        os.kill(before[1]["pid"], signal.SIGKILL)  # rank 1: the leader goes with it
        wait_for(lambda: not pid_alive(before[0]["pid"]), 30, "the leader to be taken down")
        return wait_for(restarted, 120, "the group to restart")

    def restarted() -> dict[int, Any] | None:
        ws = {w["device"]: w for w in d.status()["workers"]}
        new = all(w["state"] == "ready" and w["pid"] != before[w["device"]]["pid"]
                  for w in ws.values())  # fmt: skip
        return ws if new else None

    async def add_and_decode(c: Client) -> None:
        await c.add_sequence("model", 0, 1, [4, 5, 6], [0])
        await c.decode("model", 0, [1])

    async def main() -> dict[int, Any]:
        async with Client(d.endpoint, timeout=60) as c:
            await add_and_decode(c)
            after = await asyncio.to_thread(kill_rank_1)
            try:
                await c.decode("model", 0, [1])
            except GraphlaneError as exc:
                assert exc.code == "STATE_LOST", exc
            else:
                raise AssertionError("a sequence of the old group decoded")
            assert await c.reset_state(0) == after[0]["generation"]
            await add_and_decode(c)  # added again: it works
            x = _inputs(3)
            r = await c.step("allreduce", 0, {"actual_seq_lengths_kv": [KV]}, x)
            torch.testing.assert_close(r.outputs["out"], _expected(x, [KV]))
            return after

    after = asyncio.run(main())
    assert {w["restarts"] for w in after.values()} == {1}
    assert after[0]["generation"] == after[1]["generation"] == before[0]["generation"] + 1
    text = urllib.request.urlopen(d.status()["metrics"], timeout=30).read()
    assert b'graphlane_group_rank_behind_steps{device="1",group="0",rank="1"}' in text
