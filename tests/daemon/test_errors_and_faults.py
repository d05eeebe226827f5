"""Every error code from a request that should produce it; a worker killed with
SIGKILL under load; SIGTERM under load; malformed frames; orphaned workers."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from typing import Any

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio
from daemons import RunningDaemon, pid_alive, until, wait_for

from graphlane import GraphlaneError
from graphlane.client import Client
from graphlane.client.transport import Channel, Sockets
from graphlane.protocol import ops, wire

STEP = {"actual_seq_lengths_kv": [3]}
SLOW = {"mode": "timed", "task_us": 20000.0, "patch_us": 200.0}  # 2 layers: ~40 ms a replay


async def expect_code(coro: Any, code: str) -> GraphlaneError:
    with pytest.raises(GraphlaneError) as err:
        await coro
    assert err.value.code == code, err.value
    return err.value


async def raw_call(endpoint: str, frames: list[bytes], wait_s: float = 10) -> list[bytes] | None:
    """Send raw frames on a fresh DEALER; the reply frames, or None if none came."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart(frames)
        if await sock.poll(int(wait_s * 1000)):
            return list(await sock.recv_multipart())
        return None
    finally:
        sock.close(0)
        ctx.destroy(linger=0)


def test_request_errors_carry_their_codes(start_daemon) -> None:
    d: RunningDaemon = start_daemon(devices=2)
    worker0 = d.worker(0)["endpoint"]

    async def main() -> None:
        async with Client(d.endpoint, timeout=30) as c:
            await expect_code(
                c.step("attention", 0, {"actual_seq_lengths_kv": [99]}), "BAD_REQUEST"
            )
            await expect_code(c.step("attention", 0, {"lengths": [3]}, batch=1), "BAD_REQUEST")
            await expect_code(c.step("decoder", 0, STEP), "UNKNOWN_PROGRAM")
            await expect_code(c.step("attention", 7, STEP), "UNKNOWN_DEVICE")
            await expect_code(c.drain(device=9), "UNKNOWN_DEVICE")
            # A step sent to the daemon's own socket is refused, naming the worker endpoints.
            err = await expect_code(
                c._call(c._channel(), "step", ops.Step("attention", 0, STEP), 10),
                "BAD_REQUEST",
            )
            assert "worker" in err.message
            # Draining a device: new steps there get SHUTTING_DOWN; the other serves on.
            await c.drain(device=1)
            e = await expect_code(c.step("attention", 1, STEP), "SHUTTING_DOWN")
            assert e.retryable
            assert (await c.step("attention", 0, STEP)).outputs["out"].shape[0] == 1
        bad_version = msgpack.packb({"v": 2, "id": 41, "op": "status", "body": {}})
        (reply,) = wire.decode_replies(await raw_call(worker0, [bad_version]))
        assert isinstance(reply, wire.Reply)
        assert reply.id == 41 and reply.error is not None
        assert reply.error.code == "UNSUPPORTED_VERSION"

    asyncio.run(main())


def test_busy_and_timeout(start_daemon) -> None:
    d = start_daemon(devices=1, max_queued=1, sim=SLOW)

    async def main() -> None:
        async with Client(d.endpoint, timeout=60) as c:
            calls = [
                c.step("attention", 0, {"actual_seq_lengths_kv": [1 + i % 30]}) for i in range(12)
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            busy = [r for r in results if isinstance(r, GraphlaneError)]
            ok = [r for r in results if not isinstance(r, BaseException)]
            assert busy and ok and len(busy) + len(ok) == 12  # exactly one answer each
            assert all(e.code == "BUSY" and e.retryable for e in busy)
            e = await expect_code(c.step("attention", 0, STEP, timeout=0.001), "TIMEOUT")
            assert e.retryable
            assert (await c.step("attention", 0, STEP)).outputs["out"].shape[0] == 1

    asyncio.run(main())


def test_worker_killed_under_load_recovers_and_others_are_undisturbed(start_daemon) -> None:
    d = start_daemon(devices=2, sim=SLOW)
    victim, worker_ep = d.worker(0)["pid"], d.worker(0)["endpoint"]

    async def load(c: Client, device: int, n: int) -> list[Any]:
        return await asyncio.gather(
            *(
                c.step("attention", device, {"actual_seq_lengths_kv": [1 + i % 30]})
                for i in range(n)
            ),
            return_exceptions=True,
        )

    async def main() -> None:
        async with Client(d.endpoint, timeout=120) as c:
            await c.step("attention", 0, STEP)  # both channels connected
            await c.step("attention", 1, STEP)
            on0 = asyncio.ensure_future(load(c, 0, 20))
            on1 = asyncio.ensure_future(load(c, 1, 20))
            await until(lambda: len(c._workers[0].pending) >= 5)
            os.kill(victim, signal.SIGKILL)
            r0, r1 = await on0, await on1
            lost = [r for r in r0 if isinstance(r, GraphlaneError)]
            assert lost, "calls in flight on the killed worker must fail"
            assert all(e.code == "WORKER_LOST" and e.retryable for e in lost)
            # Issue 43: the message named two endpoints with "at" twice ("device 0 at
            # tcp://daemon at tcp://worker"); the worker's endpoint is the one it was at.
            for e in lost:
                assert str(e).count(" at ") == 1 and worker_ep in str(e), str(e)
            assert not any(isinstance(r, BaseException) for r in r1), r1

    asyncio.run(main())

    def restarted() -> dict[str, Any] | None:
        w = d.worker(0)
        return w if w["state"] == "ready" and w["restarts"] == 1 else None

    back = wait_for(restarted, 120, "device 0 to be restarted")
    assert back["pid"] != victim and not pid_alive(victim)
    assert d.worker(1)["restarts"] == 0

    async def again() -> None:
        async with Client(d.endpoint, timeout=60) as c:
            r = await c.step("attention", 0, {"actual_seq_lengths_kv": [5, 6]})
            assert r.outputs["out"].shape[0] == 2

    asyncio.run(again())


def test_sigterm_under_load_finishes_accepted_calls_and_exits_zero(start_daemon) -> None:
    d = start_daemon(devices=2, sim=SLOW)
    pids = [w["pid"] for w in d.status()["workers"]]

    async def main() -> tuple[list[Any], int]:
        async with Client(d.endpoint, timeout=120) as c:
            await c.step("attention", 0, STEP)
            await c.step("attention", 1, STEP)
            calls = [
                asyncio.ensure_future(
                    c.step("attention", i % 2, {"actual_seq_lengths_kv": [1 + i]})
                )
                for i in range(16)
            ]
            # Calls the workers have accepted (in flight there, not just sent).
            accepted = 0
            for _ in range(200):
                accepted = sum([(await c.worker_status(dev))["inflight"] for dev in (0, 1)])
                if accepted >= 6:
                    break
            assert accepted >= 6, "the workers never held 6 calls at once"
            d.send_signal(signal.SIGTERM)
            return await asyncio.gather(*calls, return_exceptions=True), accepted

    results, accepted = asyncio.run(main())
    ok = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, GraphlaneError)]
    assert len(ok) + len(refused) == len(results)  # one answer each
    assert len(ok) >= accepted, results  # what the workers had accepted completed
    # Not accepted: refused while draining, or still on the wire when a worker closed.
    assert all(e.code in ("SHUTTING_DOWN", "WORKER_LOST") for e in refused), refused
    assert d.stop() == 0
    wait_for(lambda: not any(pid_alive(p) for p in pids), 10, "workers to exit")


def test_malformed_frames_get_answers_when_they_can_and_break_nothing(shared_daemon) -> None:
    d = shared_daemon(devices=1)
    worker = d.worker(0)["endpoint"]
    good = wire.encode_request(5, "step", ops.Step("attention", 0, STEP))
    good_bytes = [bytes(f) for f in good]
    cases: list[tuple[list[bytes], str | None]] = [
        ([b"\x00garbage\xff"], None),
        ([good_bytes[0][:-3]], "BAD_REQUEST"),  # truncated msgpack: its id is still readable
        # An array is a bundle (to a worker): three envelopes, none of them a map.
        ([msgpack.packb([1, 2, 3])], None),
        ([msgpack.packb({"v": 1, "id": 6, "op": 7, "body": {}})], "BAD_REQUEST"),
        ([msgpack.packb({"v": 1, "id": 7, "op": "explode", "body": {}})], "BAD_REQUEST"),
        (
            [msgpack.packb({"v": 1, "id": 8, "op": "step", "body": {"program": "attention"}})],
            "BAD_REQUEST",
        ),
        ([*good_bytes, b"extra"], "BAD_REQUEST"),
        (
            [
                msgpack.packb(
                    {
                        "v": 1,
                        "id": 9,
                        "op": "step",
                        "body": {
                            "program": "attention",
                            "device": 0,
                            "params": STEP,
                            "inputs": {
                                "query": {
                                    "$tensor": {
                                        "dtype": "float16",
                                        "shape": [2**20, 2**20],
                                        "frame": 1,
                                    }
                                }
                            },
                        },
                    }
                ),
                b"x" * 16,
            ],
            "BAD_REQUEST",
        ),
        (
            [
                msgpack.packb(
                    {"v": 1, "id": 10, "op": "status", "body": {"deep": [[[[[[[[[[1]]]]]]]]]]}}
                )
            ],
            "BAD_REQUEST",
        ),
    ]

    async def main() -> None:
        async with Client(d.endpoint) as c:
            undecodable = (await c.worker_status(0))["counters"]["undecodable"]
        for frames, code in cases:
            for endpoint in (worker, d.endpoint):
                reply = await raw_call(endpoint, frames, wait_s=1.0 if code is None else 10)
                if code is None:
                    assert reply is None  # no id could be read: counted, not answered
                else:
                    assert reply is not None
                    (r,) = wire.decode_replies(reply)
                    assert isinstance(r, wire.Reply)
                    assert r.error is not None and r.error.code == code, (frames[:1], r.error)
        async with Client(d.endpoint) as c:
            r = await c.step("attention", 0, {"actual_seq_lengths_kv": [2, 3]})
            assert r.outputs["out"].shape[0] == 2
            ws = await c.worker_status(0)
            # The garbage and the three envelopes of [1, 2, 3]; the daemon, which takes
            # no bundles, drops [1, 2, 3] as one message.
            assert ws["counters"]["undecodable"] - undecodable == 4

    asyncio.run(main())
    assert d.worker(0)["restarts"] == 0


def test_workers_exit_when_the_orchestrator_is_killed(start_daemon) -> None:
    d = start_daemon(devices=2)
    pids = [w["pid"] for w in d.status()["workers"]]
    assert d.stop(signal.SIGKILL) == -signal.SIGKILL
    wait_for(lambda: not any(pid_alive(p) for p in pids), 30, "orphaned workers to exit")


def test_step_inputs_travel_as_frames(shared_daemon) -> None:
    """A large input is a separate frame sharing the tensor's memory, not msgpack bytes."""
    k = torch.randn(2, 4, 2, 32, 16).half()  # [layers, batch, kv heads, max kv, head dim]
    frames = wire.encode_request(1, "step", ops.Step("attention", 0, inputs={"key": k}))
    assert len(frames) == 2 and memoryview(frames[1]).nbytes == k.numel() * 2
    assert torch.frombuffer(frames[1], dtype=torch.float16).data_ptr() == k.data_ptr()
    d = shared_daemon(devices=1)
    out = asyncio.run(_one(d.endpoint, k))
    assert out.shape == (4, 4, 1, 16)


async def _one(endpoint: str, k: torch.Tensor) -> torch.Tensor:
    async with Client(endpoint) as c:
        inputs = {"key": k, "value": k}
        r = await c.step("attention", 0, {"actual_seq_lengths_kv": [1] * 4}, inputs)
        return r.outputs["out"]


def test_a_device_fault_answers_internal_and_the_worker_is_restarted(start_daemon) -> None:
    d = start_daemon(devices=1, faults={"device_fault_after": 2})
    first = d.worker(0)["pid"]

    async def main() -> None:
        async with Client(d.endpoint, timeout=30) as c:
            await c.step("attention", 0, STEP)
            await c.step("attention", 0, STEP)
            e = await expect_code(c.step("attention", 0, STEP), "INTERNAL")
            assert not e.retryable

    asyncio.run(main())

    def restarted() -> dict[str, Any] | None:
        w = d.worker(0)
        return w if w["pid"] != first and w["state"] == "ready" else None

    assert wait_for(restarted, 120, "the faulted worker to be restarted")["restarts"] == 1


@pytest.mark.parametrize("bundle_max", [1, 16])
def test_calls_past_the_send_queue_limit_wait_for_room_and_time_out_without_hanging(
    bundle_max: int,
) -> None:
    """A peer that never answers (nothing listens): the first ~1000 messages queue in
    the socket, the next ones find no room and wait for it; all calls end at their
    deadline with TIMEOUT, and the channel closes cleanly. With bundles, each message
    carries up to bundle_max calls."""

    async def main() -> None:
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        sockets = Sockets()
        ch = Channel(sockets, f"tcp://127.0.0.1:{port}", "nobody", bundle_max=bundle_max)
        try:
            n = (ch.sock.getsockopt(zmq.SNDHWM) + 100) * bundle_max
            status = ops.OPS["status"]
            calls = [ch.call(i + 1, status, ops.Status(), 0.5) for i in range(n)]
            results = await asyncio.wait_for(
                asyncio.gather(*calls, return_exceptions=True), timeout=30
            )
            assert all(isinstance(r, GraphlaneError) and r.code == "TIMEOUT" for r in results)
            assert ch.pending == {}
        finally:
            await ch.close()
            assert len(sockets) == 0  # the channel closed both of its sockets

    asyncio.run(main())
