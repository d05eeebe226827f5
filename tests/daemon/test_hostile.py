"""A hostile client's messages, on real sockets: none kills a worker or deafens the daemon.

Nested a thousand levels deep, over a size limit, or anything the structure-aware
fuzzing (tests/hostile.py) makes: each is answered when its id can be read (BAD_REQUEST,
TOO_LARGE: not retryable), dropped and logged otherwise; the worker keeps its pid and
generation, the daemon keeps answering, the connection stays up. The client's reader
likewise survives any reply.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import hostile
import msgpack
import pytest
import torch
import zmq
from daemons import RunningDaemon
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphlane import GraphlaneError
from graphlane.client import Client, SyncClient
from graphlane.client.transport import Channel, Sockets
from graphlane.protocol import ErrorCode, ops, wire

DEEP = hostile.Packed(hostile.nested(1000), "1000 deep")
STEP = {"actual_seq_lengths_kv": [3]}


class Dealer:
    """One raw DEALER connection: send any frames, read replies until one names an id."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.ids = itertools.count(2**40)  # far from the ids the fuzzing sends

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def send(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames)

    def replies_until(self, request_id: int, wait_s: float = 30) -> list[wire.Reply]:
        """Every reply that arrives until the one to ``request_id`` (the last of the list)."""
        deadline = time.monotonic() + wait_s
        out: list[wire.Reply] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                pytest.fail(f"no reply to {request_id} within {wait_s} s (got {out})")
            for reply in wire.decode_replies(self.sock.recv_multipart()):
                assert isinstance(reply, wire.Reply), reply  # servers send readable replies
                out.append(reply)
                if reply.id == request_id:
                    return out

    def call(self, frames: list[Any], request_id: int) -> wire.Reply:
        self.send(frames)
        return self.replies_until(request_id)[-1]

    def probe(self, op: str = "status") -> list[wire.Reply]:
        """A status (or hello) after what was sent: the replies up to its answer."""
        i = next(self.ids)
        body = ops.Status() if op == "status" else ops.Hello(client="probe")
        self.send(list(wire.encode_request(i, op, body)))
        replies = self.replies_until(i)
        assert replies[-1].error is None, replies[-1].error
        return replies


def refused(reply: wire.Reply, code: ErrorCode, request_id: int) -> None:
    assert reply.id == request_id
    assert reply.error is not None and reply.error.code == code, reply.error
    assert not reply.error.retryable


def health(d: RunningDaemon) -> tuple[Any, ...]:
    w = d.worker(0)
    return w["pid"], w["generation"], w["restarts"], w["state"]


def test_a_message_nested_1000_deep_is_answered_and_kills_nothing(shared_daemon) -> None:
    """Issue 28 (1): sent to a worker it raised RecursionError and the worker restarted
    (five times in 20 s: the device failed for good); sent to the daemon it ended its
    request loop without a word."""
    d = shared_daemon(devices=1)
    before = health(d)
    deep_messages = [
        {"v": 1, "id": 7, "op": "step", "body": {"program": "attention", "params": DEEP}},
        {"v": 1, "id": 7, "body": DEEP, "op": "status"},  # op last: skipped to find it
        {"id": 7, "v": DEEP, "op": "status", "body": {}},
        {"v": 1, "id": 7, "op": "hello", "body": {"client": DEEP}},
    ]
    for endpoint in (d.worker(0)["endpoint"], d.endpoint):
        dealer = Dealer(endpoint)
        try:
            for message in deep_messages * 2:  # more than the supervisor's restart budget
                refused(dealer.call([hostile.pack(message)], 7), ErrorCode.BAD_REQUEST, 7)
            dealer.send([hostile.pack(DEEP)])  # no id to answer: dropped, counted
            dealer.probe("hello")
        finally:
            dealer.close()
    assert health(d) == before

    async def main() -> None:
        async with Client(d.endpoint, timeout=10) as c:
            assert (await c.hello())["workers"][0]["pid"] == before[0]
            r = await c.step("attention", 0, STEP)
            assert r.generation == before[1]

    asyncio.run(main())


def test_a_message_over_a_size_limit_is_answered_too_large(shared_daemon) -> None:
    """Issue 28 (7): an envelope over the limit was cut (the daemon: the connection
    dropped) or dropped (a worker): the client waited, then heard WORKER_LOST retryable.
    Now TOO_LARGE, not retryable, with its id, and the connection stays up."""
    d = shared_daemon(devices=1)
    before = health(d)
    big_step = msgpack.packb(
        {"v": 1, "id": 11, "op": "step", "body": {"program": "attention", "device": 0,
                                                    "params": {"x": [1] * (2**20 + 10)}}}
    )  # fmt: skip
    big_hello = msgpack.packb(
        {"v": 1, "id": 11, "op": "hello", "body": {"client": "x" * (2**20 + 10)}}
    )
    many = [*wire.encode_request(11, "status", ops.Status()), *[b""] * 64]
    for endpoint, big in ((d.worker(0)["endpoint"], big_step), (d.endpoint, big_hello)):
        dealer = Dealer(endpoint)
        try:
            for frames in ([big], many):
                refused(dealer.call(frames, 11), ErrorCode.TOO_LARGE, 11)
                dealer.probe()  # the same connection: not cut
        finally:
            dealer.close()
    assert health(d) == before


def test_the_client_refuses_what_the_worker_would_cut_and_loses_nothing(shared_daemon) -> None:
    """A tensor over the worker's message limit (its socket cuts such a frame, with no
    reply): the client raises TOO_LARGE unsent, and its other calls are unaffected."""
    d = shared_daemon(devices=1)

    async def main() -> None:
        async with Client(d.endpoint, timeout=30) as c:
            await c.step("attention", 0, STEP)
            huge = torch.empty(wire.DEFAULT_LIMITS.max_message_bytes + 1, dtype=torch.uint8)
            other = asyncio.ensure_future(c.step("attention", 0, {"actual_seq_lengths_kv": [2]}))
            for params, inputs in (
                (STEP, {"query": huge}),
                ({"actual_seq_lengths_kv": [1] * (2**20 + 1)}, None),  # an envelope over 1 MiB
            ):
                with pytest.raises(GraphlaneError) as err:
                    await c.step("attention", 0, params, inputs, batch=1)
                assert err.value.code == ErrorCode.TOO_LARGE and not err.value.retryable
            assert (await other).bucket >= 1
            assert (await c.step("attention", 0, STEP)).bucket >= 1

    asyncio.run(main())


def test_the_clients_reader_survives_any_reply(tmp_path) -> None:
    """A reply nested 1000 deep stopped the client's reader (a RecursionError out of its
    callback): its call, and every later one, waited out its timeout. Now the call
    with a readable id fails INTERNAL at once and the connection keeps working."""
    endpoint = f"ipc://{tmp_path}/server.sock"
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(endpoint)

    def serve(replies: list[list[bytes]]) -> None:
        ident, *_ = server.recv_multipart()
        for frames in replies:
            server.send_multipart([ident, *frames])

    async def main() -> None:
        sockets = Sockets()
        ch = Channel(sockets, endpoint, "fake")
        status = ops.OPS["status"]
        loop = asyncio.get_running_loop()
        try:
            deep = hostile.pack({"v": 1, "id": 1, "ok": True, "body": DEEP})
            garbage = [b"\xc1\x00", hostile.pack(DEEP), b"\x91" * 100_000]
            good = list(wire.encode_reply(2, {"state": "fine"}))
            call = asyncio.ensure_future(ch.call(1, status, ops.Status(), 20))
            await loop.run_in_executor(None, serve, [[deep]])
            with pytest.raises(GraphlaneError) as err:
                await call
            assert err.value.code == ErrorCode.INTERNAL  # at once: not TIMEOUT
            call = asyncio.ensure_future(ch.call(2, status, ops.Status(), 20))
            await loop.run_in_executor(None, serve, [[g] for g in garbage] + [good])
            assert await call == {"state": "fine"}
        finally:
            await ch.close()

    try:
        asyncio.run(main())
    finally:
        server.close(0)
        ctx.term()


FUZZ = settings(
    max_examples=250,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


@pytest.mark.parametrize("socket", ["worker", "daemon"])
def test_fuzzing_a_socket_kills_nothing(shared_daemon, socket: str) -> None:
    """Structure-aware messages (tests/hostile.py) on one connection, each followed by a
    status: it is answered every time, every reply is readable and none is INTERNAL
    (a request the server failed to foresee); the worker keeps its pid and generation,
    the daemon answers hello and status."""
    d = shared_daemon(devices=1)
    before = health(d)
    endpoint = d.worker(0)["endpoint"] if socket == "worker" else d.endpoint
    dealer = Dealer(endpoint)

    @FUZZ
    @given(hostile.messages())
    def one(frames: list[bytes]) -> None:
        dealer.send(frames)
        for reply in dealer.probe():
            assert reply.error is None or reply.error.code != ErrorCode.INTERNAL, reply.error

    try:
        one()
        dealer.probe("hello")
    finally:
        dealer.close()
    assert health(d) == before
    assert d.status()["state"] == "running"


def test_a_bundle_of_more_requests_than_the_bound_is_refused_unread(shared_daemon) -> None:
    """Issue 40 (7): a 0.96 MB bundle of 40,000 status requests made 121 MB of replies and
    kept the worker deaf for seconds. A bundle of more than Limits.max_bundle requests is
    refused before any is answered (counted, logged throttled); the next request on the
    same connection is the only one answered."""
    d = shared_daemon(devices=1)
    before = health(d)
    n = 40_000
    status = [bytes(wire.encode_request(i + 1, "status", ops.Status())[0]) for i in range(n)]
    flood = b"\xdc" + n.to_bytes(2, "big") + b"".join(status)
    assert len(flood) < 2**20  # within the envelope limit: the bound is the count
    for endpoint in (d.worker(0)["endpoint"], d.endpoint):
        dealer = Dealer(endpoint)
        try:
            dealer.send([flood])
            assert len(dealer.probe()) == 1  # the probe's own reply, nothing of the flood
        finally:
            dealer.close()
    assert health(d) == before


PAGED = {"name": "paged_attention", "layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 16, "block_size": 128, "num_blocks": 6, "max_blocks_per_seq": 2,
         "buckets": [1]}  # fmt: skip
SLOTS = PAGED["num_blocks"] * PAGED["block_size"]


def paged_kv_read(request_id: int, generation: int) -> list[Any]:
    body = ops.KvRead(
        program="paged_attention", device=0, slots=torch.arange(SLOTS), generation=generation
    )
    return list(wire.encode_request(request_id, "kv_read", body))


def test_frame_bombs_unread_replies_and_churn_leave_another_clients_state_exact(
    shared_daemon,
) -> None:
    """Issue 40's classes together, on a worker keeping device state and on the daemon:
    messages padded with frames around and far over the limit (tests/hostile.py
    frame_bombs), connections that ask for large replies and close without reading
    them, one that reads nothing at all, and churn. Each bomb is answered or dropped
    and the connection serves on; afterwards the worker has its pid and generation,
    another client's KV cache reads back exactly, and its step gives the same outputs,
    bit for bit."""
    d = shared_daemon(devices=1, programs=[PAGED], max_unread_reply_bytes=2**20)
    before = health(d)
    worker = d.worker(0)
    gen = torch.Generator().manual_seed(40)
    shape = (PAGED["layers"], 4, PAGED["num_kv_heads"], PAGED["head_dim"])
    key = torch.randn(shape, generator=gen).to(torch.float16)
    value = torch.randn(shape, generator=gen).to(torch.float16)
    mine = [256, 257, 258, 259]  # block 2
    query = torch.randn((1, PAGED["num_heads"], PAGED["head_dim"]), generator=gen)
    step = {
        "params": {"actual_seq_lengths_kv": [4]},
        "inputs": {"query": query.to(torch.float16), "key": key[:, 3:], "value": value[:, 3:],
                   "slot_mapping": torch.tensor([259]),
                   "block_table": torch.tensor([[2, 3]], dtype=torch.int32)},
    }  # fmt: skip

    with SyncClient(d.endpoint, timeout=60) as other:
        other.kv_write("paged_attention", 0, mine, key, value)
        first = other.step("paged_attention", 0, **step).outputs

        dealers = {name: Dealer(ep) for name, ep in (("worker", worker["endpoint"]),
                                                     ("daemon", d.endpoint))}  # fmt: skip
        try:

            @settings(FUZZ, max_examples=40)
            @given(hostile.frame_bombs(), st.sampled_from(sorted(dealers)))
            def bomb(frames: list[bytes], where: str) -> None:
                dealers[where].send(frames)
                for reply in dealers[where].probe():
                    assert reply.error is None or reply.error.code != ErrorCode.INTERNAL

            bomb()
        finally:
            for dealer in dealers.values():
                dealer.close()

        # Churn: connections that ask for replies (some over the bound) and go unread.
        for i in range(30):
            churn = Dealer(worker["endpoint"])
            if i % 3 == 0:
                churn.sock.setsockopt(zmq.RCVHWM, 1)
            for j in range(i % 4 + 1):
                churn.send(paged_kv_read(10_000 + j, worker["generation"]))
            churn.send([b"\x91" * 5, *[b""] * (i * 50)])  # and a frame bomb
            churn.close()
        deaf = Dealer(worker["endpoint"])
        deaf.sock.setsockopt(zmq.RCVHWM, 1)
        try:
            for j in range(20):
                deaf.send(paged_kv_read(20_000 + j, worker["generation"]))
            assert torch.equal(other.kv_read("paged_attention", 0, mine).outputs["key"], key)
        finally:
            deaf.close()

        back = other.kv_read("paged_attention", 0, mine).outputs
        assert torch.equal(back["key"], key) and torch.equal(back["value"], value)
        again = other.step("paged_attention", 0, **step).outputs
        assert first.keys() == again.keys()
        assert all(torch.equal(first[k], again[k]) for k in first)
    assert health(d) == before
