"""One connection's requests to a device with state: a step never runs on device state
that an earlier request of the same connection failed to apply (docs/programs.md,
"Ordering and retries").

The worker's queue is driven deterministically: the device hangs at its first replay
(``hang_device_after = 0``), so eight steps of another program hold every in-flight
permit and requests after them wait in the queue (``max_queued = 2``) until their
deadline (``timeout_ms``); requests of one bundle are all taken before the queue is
looked at again. A raw DEALER plays the scheduler that pipelined a step behind its
write: it sends the step before (and without) acknowledging the write's failure."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from daemons import SMALL, RunningDaemon
from paged_kv import Scheduler
from test_paged_state import CFG, PAGED

from graphlane import GraphlaneError
from graphlane.client import Client
from graphlane.protocol import ops, wire


class RawConnection:
    """One DEALER to a worker: requests as the test frames them, replies by id."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.replies: dict[int, wire.Reply] = {}

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.destroy(linger=0)

    async def send(self, *requests: tuple[int, str, Any]) -> None:
        """``requests`` as one message (a bundle when there are several)."""
        envelopes = []
        for request_id, op, body in requests:
            frames = wire.encode_request(request_id, op, body)
            assert len(frames) == 1  # small tensors travel inline: bundles take them
            envelopes.append(bytes(frames[0]))
        ((_, payload),) = wire.bundles(envelopes)
        await self.sock.send(payload)

    async def reply(self, request_id: int, limit_s: float = 20) -> wire.Reply:
        deadline = time.monotonic() + limit_s
        while request_id not in self.replies:
            left = deadline - time.monotonic()
            if left <= 0 or not await self.sock.poll(int(left * 1000)):
                pytest.fail(f"no reply to request {request_id} within {limit_s:g} s")
            for r in wire.decode_replies(await self.sock.recv_multipart()):
                assert isinstance(r, wire.Reply)
                self.replies[r.id] = r
        return self.replies.pop(request_id)

    async def code(self, request_id: int) -> str | None:
        r = await self.reply(request_id)
        return str(r.error.code) if r.error is not None else None


def _attention(timeout_ms: int | None = None) -> ops.Step:
    return ops.Step("attention", 0, {"actual_seq_lengths_kv": [3]}, timeout_ms=timeout_ms)


def test_a_step_queued_or_sent_behind_a_refused_write_is_refused_until_resume(
    start_daemon: Any,
) -> None:
    d: RunningDaemon = start_daemon(
        devices=1, programs=[PAGED, SMALL], max_queued=2, hang_timeout_s=120.0,
        shutdown_timeout_s=2.0, faults={"hang_device_after": 0},
    )  # fmt: skip
    worker = d.worker(0)
    gen = worker["generation"]
    sched = Scheduler(CFG, torch.Generator().manual_seed(4))
    slots, k, v = sched.prefill(0, 5)
    write = ops.KvWrite("paged_attention", 0, slots, k, v, gen)
    inputs, lengths = sched.decode([0])
    step = ops.Step("paged_attention", 0, {"actual_seq_lengths_kv": lengths}, inputs,
                    ["out"], timeout_ms=3000, generation=gen)  # fmt: skip

    async def main() -> None:
        conn = RawConnection(worker["endpoint"])
        try:
            # Eight steps of a stateless program hold every permit: the device hangs.
            await conn.send(*((i, "step", _attention()) for i in range(1, 9)))
            deadline = time.monotonic() + 20
            while True:
                await conn.send((100, "status", ops.Status()))
                st = msgspec_map(await conn.reply(100))
                if st["inflight"] == 8 and st["queued"] == 0:
                    break
                assert time.monotonic() < deadline, st
                await asyncio.sleep(0.02)  # a poll of the worker's status

            # BUSY: two requests fill the queue, the write behind them is refused.
            await conn.send((9, "step", _attention(1)), (10, "step", _attention(1)),
                            (11, "kv_write", write))  # fmt: skip
            assert await conn.code(11) == "BUSY"
            assert await conn.code(9) == "TIMEOUT" and await conn.code(10) == "TIMEOUT"
            # The queue has room again. The step pipelined behind the write, sent before
            # its sender saw the BUSY, must not run on a cache without that write.
            await conn.send((12, "step", step))
            r = await conn.reply(12)
            assert r.error is not None and r.error.code == "PREDECESSOR_FAILED", r.error
            assert r.error.retryable and "request 11 " in r.error.message  # names it
            # A stateless program's requests are not refused; a kv_read is.
            await conn.send((13, "step", _attention(1)))
            assert await conn.code(13) == "TIMEOUT"
            await conn.send((14, "kv_read", ops.KvRead("paged_attention", 0, slots, gen)))
            assert await conn.code(14) == "PREDECESSOR_FAILED"
            await conn.send((15, "resume", ops.Resume(0)))
            assert msgspec_map(await conn.reply(15)) == {"resumed": 11}

            # TIMEOUT: a write that waited past its deadline was never applied; the step
            # waiting behind it is refused at once (not left to run, or to time out).
            late = ops.KvWrite("paged_attention", 0, slots, k, v, gen, timeout_ms=1)
            await conn.send((16, "kv_write", late), (17, "step", step))
            assert await conn.code(16) == "TIMEOUT"
            assert await conn.code(17) == "PREDECESSOR_FAILED"
            await conn.send((18, "resume", ops.Resume(0)))
            assert msgspec_map(await conn.reply(18)) == {"resumed": 16}
            # Resumed: the write is accepted again (and waits: the device hangs).
            await conn.send((19, "kv_write", late))
            assert await conn.code(19) == "TIMEOUT"
        finally:
            conn.close()

    asyncio.run(main())


def msgspec_map(reply: wire.Reply) -> dict[str, Any]:
    body: dict[str, Any] = reply.body(ops.OPS["status"])
    return body


def test_the_client_resumes_after_a_failed_write_and_a_retry_is_served(
    shared_daemon: Any,
) -> None:
    """graphlane's Client: a step pipelined behind a refused write is refused; once the
    caller saw the failure, the write sent again (idempotent) and the step are served."""
    d: RunningDaemon = shared_daemon(devices=1, programs=[PAGED])
    sched = Scheduler(CFG, torch.Generator().manual_seed(6))
    slots, k, v = sched.prefill(0, 40)
    inputs, lengths = sched.decode([0])
    expected = sched.expected([0], inputs["query"])

    async def main() -> None:
        async with Client(d.endpoint, timeout=20) as c:
            await c.hello()
            await c._worker(0)  # connected: both calls below go out in one turn
            wrong = k[:, :, :1]  # a malformed write: refused, nothing applied
            write, decode = await asyncio.gather(
                c.kv_write("paged_attention", 0, slots, wrong, v),
                c.step("paged_attention", 0, {"actual_seq_lengths_kv": lengths}, inputs),
                return_exceptions=True,
            )
            assert isinstance(write, GraphlaneError) and write.code == "BAD_REQUEST"
            assert isinstance(decode, GraphlaneError) and decode.code == "PREDECESSOR_FAILED"
            await c.kv_write("paged_attention", 0, slots, k[:, :40], v[:, :40])
            await c.kv_write("paged_attention", 0, slots, k[:, :40], v[:, :40])  # a retry
            r = await c.step("paged_attention", 0, {"actual_seq_lengths_kv": lengths}, inputs)
            torch.testing.assert_close(r.outputs["out"], expected, atol=3e-3, rtol=3e-3)

    asyncio.run(main())
