"""The paged_attention program served by a daemon: a scheduler's decode run through the
client (kv_write prefills, decode steps checked against SDPA over the scheduler's own
copy of the KV), and a worker killed in the middle of it: no step after the restart
returns numbers until the scheduler adopts the new generation and writes the KV again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from daemons import RunningDaemon, finish, launch, wait_for
from paged_kv import Scheduler

from graphlane import GraphlaneError
from graphlane.client import Client
from graphlane.workers.programs import PagedAttentionConfig

PAGED = {"name": "paged_attention", "layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 16, "block_size": 128, "num_blocks": 8, "max_blocks_per_seq": 2,
         "buckets": [1, 2, 4]}  # fmt: skip
CFG = PagedAttentionConfig(
    **{k: v for k, v in PAGED.items() if k != "name"} | {"buckets": (1, 2, 4)}
)  # type: ignore[arg-type]
TOL = dict(atol=3e-3, rtol=3e-3)


async def _prefill(c: Client, sched: Scheduler, lengths: dict[int, int]) -> None:
    for sid, n in lengths.items():
        slots, k, v = sched.prefill(sid, n)
        await c.kv_write("paged_attention", 0, slots, k, v)


async def _rewrite(c: Client, sched: Scheduler) -> None:
    for seq in sched.seqs.values():
        await c.kv_write("paged_attention", 0, sched.slots(seq, 0, seq.length), seq.keys,
                         seq.values)  # fmt: skip


async def _decode(c: Client, sched: Scheduler, sids: list[int]) -> Any:
    inputs, lengths = sched.decode(sids)
    expected = sched.expected(sids, inputs["query"])
    r = await c.step("paged_attention", 0, {"actual_seq_lengths_kv": lengths}, inputs)
    torch.testing.assert_close(r.outputs["out"], expected, **TOL)
    return r


def test_a_restart_mid_decode_refuses_steps_until_the_kv_is_written_again(
    start_daemon: Any,
) -> None:
    d: RunningDaemon = start_daemon(devices=1, programs=[PAGED])
    worker = d.worker(0)
    first = worker["generation"]
    described = worker["programs"]["paged_attention"]
    assert set(described["state_ops"]) == {"kv_write", "kv_read"}
    assert described["config"]["num_blocks"] == PAGED["num_blocks"]
    assert described["inputs"]["query"] == {"shape": ["batch", 4, 16], "dtype": "float16"}
    assert described["state"]["block_size"] == 128
    sched = Scheduler(CFG, torch.Generator().manual_seed(1))

    async def main() -> None:
        async with Client(d.endpoint, timeout=20) as c:
            await _prefill(c, sched, {0: 100, 1: 7, 2: 129})
            for _ in range(3):
                r = await _decode(c, sched, [0, 1, 2])
                assert r.generation == first
            assert c.generation(0) == first

            pid = (await c.status())["workers"][0]["pid"]
            os.kill(pid, signal.SIGKILL)  # mid run: the cache is gone
            outcomes: list[str] = []
            # The scheduler sends its next step until it gets an answer; the token joins
            # its copy of the KV (rewritten below, after the restart).
            inputs, lengths = sched.decode([0, 1])
            while not outcomes or outcomes[-1] != "STATE_LOST":
                assert len(outcomes) < 20, f"no STATE_LOST after the restart: {outcomes}"
                try:
                    await c.step("paged_attention", 0, {"actual_seq_lengths_kv": lengths}, inputs)
                except GraphlaneError as exc:
                    outcomes.append(str(exc.code))
                    if exc.code == "WORKER_LOST":
                        await c.wait_ready(timeout=60)  # the restarted worker is up
                    continue
                pytest.fail("a step after the restart returned numbers")
            assert set(outcomes) <= {"WORKER_LOST", "STATE_LOST"}
            # KV operations name the lost generation too: a read cannot return zeros.
            with pytest.raises(GraphlaneError) as info:
                await c.kv_read("paged_attention", 0, torch.arange(4))
            assert info.value.code == "STATE_LOST" and not info.value.retryable

            assert await c.reset_state(0) == first + 1  # one restart more
            await _rewrite(c, sched)
            for _ in range(2):
                r = await _decode(c, sched, [0, 1, 2])
                assert r.generation == first + 1
            seq = sched.seqs[2]
            read = await c.kv_read("paged_attention", 0, sched.slots(seq, 0, seq.length))
            assert torch.equal(read.outputs["key"], seq.keys)

    asyncio.run(main())
    wait_for(lambda: d.worker(0)["restarts"] == 1, 10, "the restart to be counted")


def test_a_stateful_request_must_name_a_generation(start_daemon: Any) -> None:
    d: RunningDaemon = start_daemon(devices=1, programs=[PAGED])
    sched = Scheduler(CFG, torch.Generator().manual_seed(2))
    sched.prefill(0, 5)
    inputs, lengths = sched.decode([0])

    async def main() -> None:
        async with Client(d.endpoint, timeout=20) as c:
            await c.hello()
            ch = await c._worker(0)
            from graphlane.protocol import ops

            body = ops.Step("paged_attention", 0, {"actual_seq_lengths_kv": lengths}, inputs)
            with pytest.raises(GraphlaneError) as info:
                await ch.call(99, ops.OPS["step"], body, 10)
            assert info.value.code == "BAD_REQUEST"
            stale = ops.Step(
                "paged_attention", 0, {"actual_seq_lengths_kv": lengths}, inputs, generation=7
            )
            with pytest.raises(GraphlaneError) as info:
                await ch.call(100, ops.OPS["step"], stale, 10)
            assert info.value.code == "STATE_LOST"

    asyncio.run(main())


def test_a_generation_from_an_earlier_daemon_on_the_same_endpoint_is_state_lost(
    tmp_path: Path,
) -> None:
    """Generations are unique across daemon restarts: a client that wrote its KV to the
    daemon before, and keeps its generation, is refused by the next daemon on the same
    endpoint (whose cache is empty) instead of reading zeros or stepping on them."""
    sched = Scheduler(CFG, torch.Generator().manual_seed(3))
    slots, k, v = sched.prefill(0, 5)

    async def main() -> None:
        # The daemons start and stop in a thread: their helpers run event loops of their own.
        d = await asyncio.to_thread(launch, tmp_path, "same", devices=1, programs=[PAGED])
        try:
            async with Client(d.endpoint, timeout=20) as c:
                await c.kv_write("paged_attention", 0, slots, k, v)
                held = c.generation(0)
                assert held is not None
                await asyncio.to_thread(finish, d)  # another daemon on the same endpoint:
                d = await asyncio.to_thread(launch, tmp_path, "same", devices=1, programs=[PAGED])
                now = (await asyncio.to_thread(d.worker, 0))["generation"]
                assert c.generation(0) == held  # the client still names the old one
                codes: list[str] = []
                deadline = time.monotonic() + 30
                while not codes or codes[-1] == "WORKER_LOST":  # until it reconnects
                    assert time.monotonic() < deadline, codes
                    with pytest.raises(GraphlaneError) as info:
                        await c.kv_read("paged_attention", 0, slots)
                    codes.append(str(info.value.code))
                    await asyncio.sleep(0.02)  # a poll: the client's sockets reconnect
                assert codes[-1] == "STATE_LOST", codes
                inputs, lengths = sched.decode([0])
                with pytest.raises(GraphlaneError) as info:
                    await c.step("paged_attention", 0, {"actual_seq_lengths_kv": lengths}, inputs)
                assert info.value.code == "STATE_LOST"
                assert await c.reset_state(0) == now
        finally:
            await asyncio.to_thread(finish, d)

    asyncio.run(main())
