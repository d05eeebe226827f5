"""``send_step`` and ``send_decode``: a call sent before the method returns, with no task
or coroutine per call, whose future gives the same reply as ``step``/``decode`` would,
in the order of the calls, also when the device's channel is not up yet. Its future
ends however the call ends (reply, deadline, cancel) and the channel forgets it."""

from __future__ import annotations

import asyncio
import time
import tomllib
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch

from graphlane.client import Client, StepReply, SyncClient
from graphlane.client.args import InvalidArgument
from graphlane.demo_model import PROGRAM_TOML
from graphlane.protocol.errors import Timeout, WorkerLost

PROGRAMS = tomllib.loads(PROGRAM_TOML)["programs"]
PROMPT = [3, 1, 4, 1, 5]
AHEAD = 4


@pytest.fixture
def daemon(shared_daemon: Any) -> Any:
    return shared_daemon(devices=1, programs=PROGRAMS)


def _tokens(replies: list[Any]) -> list[int]:
    return [int(r.outputs["tokens"][0]) for r in replies]


async def test_decodes_sent_ahead_without_tasks_answer_as_awaited_ones(daemon: Any) -> None:
    async with Client(daemon.endpoint, timeout=60) as c:
        await c.add_sequence("model", 0, 1, PROMPT, [1])
        awaited = [await c.decode("model", 0, [1]) for _ in range(AHEAD)]

        await c.add_sequence("model", 0, 2, PROMPT, [2])
        tasks = asyncio.all_tasks()
        ahead = [c.send_decode("model", 0, [2]) for _ in range(AHEAD)]  # each from the last
        assert asyncio.all_tasks() == tasks  # no task per call
        channel = c._hosts[0].workers[0]
        assert len(channel.pending) == AHEAD  # all sent (or queued for this turn's send)
        replies = await asyncio.gather(*ahead)
        assert _tokens(replies) == _tokens(awaited)
        assert not channel.pending


async def test_steps_sent_before_the_channel_is_up_go_in_order(daemon: Any) -> None:
    """The first calls to a device wait for its channel in a task, in the order they were
    made: each step below decodes from the token the one before it sampled (token -1),
    so one that overtook another would decode from the wrong token or be refused."""
    table = torch.tensor([[3, 0]], dtype=torch.int32)

    def step(length: int) -> Any:
        params = {"actual_seq_lengths_kv": [length], "sequence_id": [950]}
        return {"tokens": torch.tensor([-1]), "block_table": table}, params

    async with Client(daemon.endpoint, timeout=60) as reference:
        first = await reference.prefill("model", 0, PROMPT, [4, 0], params={"sequence_id": 949})
        expected = [int(first.outputs["tokens"][0])]
        for i in range(AHEAD):
            params = {"actual_seq_lengths_kv": [len(PROMPT) + 1 + i], "sequence_id": [949]}
            inputs = {"tokens": torch.tensor([-1]), "block_table": torch.tensor([[4, 0]],
                      dtype=torch.int32)}  # fmt: skip
            expected += _tokens([await reference.step("model", 0, params, inputs, ["tokens"])])

    async with Client(daemon.endpoint, timeout=60) as c:
        assert 0 not in c._hosts[0].workers  # the device's channel is not up yet
        prefill = asyncio.ensure_future(
            c.prefill("model", 0, PROMPT, [3, 0], params={"sequence_id": 950})
        )
        await asyncio.sleep(0)  # the prefill is the first call made
        futures = []
        for i in range(AHEAD):
            inputs, params = step(len(PROMPT) + 1 + i)
            futures.append(c.send_step("model", 0, params, inputs, ["tokens"]))
        got = _tokens([await prefill]) + _tokens(await asyncio.gather(*futures))
        assert got == expected


async def test_bad_arguments_raise_at_the_send(daemon: Any) -> None:
    async with Client(daemon.endpoint, timeout=60) as c:
        with pytest.raises(InvalidArgument):
            c.send_decode("model", 0, [-1])
        with pytest.raises(InvalidArgument):
            c.send_step("model", 0, ["not", "a", "mapping"])  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            c.send_step("model", 0, {}, {"tokens": "not a tensor"})  # type: ignore[dict-item]
        assert not asyncio.all_tasks() - {asyncio.current_task()}  # nothing sent later
    # A call after the client closed is a call that failed, not a bad argument.
    late = c.send_decode("model", 0, [1])
    with pytest.raises(WorkerLost):
        await late


async def test_a_call_that_times_out_or_is_cancelled_is_forgotten(daemon: Any) -> None:
    async with Client(daemon.endpoint, timeout=60) as c:
        await c.add_sequence("model", 0, 5, PROMPT, [5])
        channel = c._hosts[0].workers[0]
        late = c.send_decode("model", 0, [5], timeout=1e-6)  # no worker answers that fast
        with pytest.raises(Timeout):
            await late
        cancelled = c.send_decode("model", 0, [5])
        cancelled.cancel()
        # (the timed-out decode fenced the connection's state: a resume is in flight)
        assert late.request_id not in channel.pending
        assert cancelled.request_id not in channel.pending
        # Both were sent: their replies come and are dropped; the channel goes on.
        reply = await c.decode("model", 0, [5])
        assert reply.outputs["tokens"].shape == (1,)
        assert not channel.pending


async def test_an_answered_call_keeps_nothing_of_its_request(daemon: Any) -> None:
    """A deadline's queue holds an ended call until its deadline passes (or compaction):
    an answered call drops its request, so that what stays alive across the loop's
    turns is one small object per call (the collector's oldest generation, collected
    in tens of ms beside torch, filled twice as fast and halved windowed steps/s)."""
    async with Client(daemon.endpoint, timeout=60) as c:
        await c.add_sequence("model", 0, 6, PROMPT, [6])
        answered = c.send_decode("model", 0, [6])
        await answered
        assert answered.body is None  # type: ignore[attr-defined]
        assert not hasattr(answered, "__dict__")  # slots only


async def test_calls_end_in_the_order_of_their_replies_however_they_were_sent(
    daemon: Any,
) -> None:
    """The first call to a device is sent by a task once the channel is up, the next one
    at once; both futures are ended by the socket's reader, in the order of the replies.
    (When the first was the sending task's own result, it ended a turn of the loop after
    a later call's: a load test timed a request's second token before its first.)"""
    table = torch.tensor([[7, 0]], dtype=torch.int32)
    inputs = {"tokens": torch.tensor([5]), "block_table": table}
    params = {"actual_seq_lengths_kv": [1]}
    with SyncClient(daemon.endpoint, timeout=60) as watcher:  # asks from a thread of its own
        before = _model_steps_done(watcher)
        async with Client(daemon.endpoint, timeout=60) as c:
            host = c._hosts[0]
            first = c.send_step("model", 0, params, inputs, ["tokens"])  # the channel is not up
            # Until the task sent the first, a turn at a time.
            await _turns_until(lambda: 0 in host.workers and not host.connecting.get(0))
            second = c.send_step("model", 0, params, inputs, ["tokens"])  # sent this turn
            ended: list[str] = []
            first.add_done_callback(lambda _: ended.append("first"))
            second.add_done_callback(lambda _: ended.append("second"))
            channel = host.workers[0]
            await _turns_until(lambda: not channel._queued)  # (it went with the turn's calls)
            # The loop held (no turn: neither reply is read) until the worker has answered
            # both, so that the reader takes the two replies in one pass.
            deadline = time.monotonic() + 30
            while _model_steps_done(watcher) < before + 2:
                assert time.monotonic() < deadline, "the worker did not answer both steps"
            await asyncio.gather(first, second)
            assert ended == ["first", "second"]


def _model_steps_done(watcher: SyncClient) -> int:
    """The model program's steps device 0's worker has answered (its metrics)."""
    metrics = watcher.worker_status(0)["metrics"]
    return sum(h["count"] for h in metrics["step_seconds"]
               if h["program"] == "model" and h["op"] == "step")  # fmt: skip


async def _turns_until(condition: Callable[[], bool], deadline_s: float = 30.0) -> None:
    """Let the loop run a turn at a time until ``condition()`` holds (at most ``deadline_s``)."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0)


def test_a_step_reply_is_immutable_and_compares_by_its_fields() -> None:
    """``StepReply`` (docs/api.md): fields as documented, defaults for the last three,
    no field reassigned, a changed copy by ``msgspec.structs.replace``."""
    reply = StepReply({"tokens": [7]}, 4, 1, 20, 0)
    assert (reply.server_us, reply.host, reply.generation) == (0.0, "", 0)
    with pytest.raises(AttributeError):
        reply.bucket = 8  # type: ignore[misc]
    assert reply == StepReply({"tokens": [7]}, 4, 1, 20, 0)
    changed = msgspec.structs.replace(reply, bucket=8)
    assert (changed.bucket, reply.bucket, changed.outputs) == (8, 4, {"tokens": [7]})
