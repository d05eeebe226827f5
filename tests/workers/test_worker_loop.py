"""The worker's loop in-process (no orchestrator, no client library): a reply that
cannot be encoded becomes an INTERNAL error and the worker serves on, whether the
step was answered on the spot (null) or from the completion thread (sim)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from multiprocessing import Pipe
from typing import Any

import pytest
import torch
import zmq

from graphlane.protocol import ops, wire
from graphlane.workers.worker import Worker, WorkerSpec

TINY = {
    "name": "attention",
    "layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 8,
    "max_kv_len": 8,
    "buckets": [1],
}


def _request(request_id: int) -> list[bytes | memoryview]:
    body = ops.Step("attention", 0, {"actual_seq_lengths_kv": [2]}, outputs=["out"])
    return wire.encode_request(request_id, "step", body)


def _step_done(reply: wire.Reply) -> ops.StepDone:
    done: ops.StepDone = reply.body(ops.OPS["step"].reply_decoder)
    return done


@pytest.mark.parametrize("backend", ["null", "sim"])
def test_an_unsendable_reply_becomes_an_internal_error_and_the_worker_serves_on(
    backend: str,
) -> None:
    here, there = Pipe()
    spec = WorkerSpec(device=0, backend=backend, programs=(TINY,), endpoint="inproc://w")
    worker = Worker(spec, here)
    replies: list[wire.Reply | wire.DecodeError] = []
    send = worker._send

    def capture(ident: Any, frames: list[Any], bundled: bool = False) -> None:
        replies.extend(wire.decode_replies([bytes(memoryview(f)) for f in frames]))
        send(ident, frames, bundled)
        if len(replies) == 2:
            worker._stopping = True

    worker._send = capture  # type: ignore[method-assign]
    program = worker.engine.programs["attention"]
    views = program.output_views
    calls = 0

    def first_unsendable(*args: Any) -> dict[str, torch.Tensor]:
        nonlocal calls
        calls += 1  # the first step's output has a dtype the wire cannot carry
        return {"out": torch.zeros(1, dtype=torch.complex64)} if calls == 1 else views(*args)

    program.output_views = first_unsendable  # type: ignore[method-assign]
    client = worker.ctx.socket(zmq.DEALER)
    try:
        client.connect("inproc://w")
        client.send_multipart(_request(1))
        client.send_multipart(_request(2))
        def serve() -> None:
            worker._main = threading.get_ident()  # the loop's thread is the issuer
            worker._serve()

        loop = threading.Thread(target=serve, daemon=True)
        loop.start()
        loop.join(60)
        assert not loop.is_alive(), "the worker loop did not answer both requests"
        assert sorted(getattr(r, 'id', None) or 0 for r in replies) == [1, 2]
        first, second = sorted(replies, key=lambda r: r.id or 0)
        assert isinstance(first, wire.Reply) and isinstance(second, wire.Reply)
        assert first.error is not None and first.error.code == "INTERNAL"
        assert "complex64" in first.error.message
        assert _step_done(second).outputs["out"].shape[0] == 1
        assert worker.inflight == 0 and worker.engine.failure is None
    finally:
        client.close(0)
        worker.engine.close()
        worker.sock.close(0)
        worker.ctx.destroy(linger=0)
        there.close()


@contextlib.contextmanager
def _serving(backend: str, endpoint: str) -> Iterator[tuple[Worker, zmq.Socket[Any]]]:
    """A worker serving ``endpoint`` from a thread (its issuer), and a DEALER to it."""
    here, there = Pipe()
    spec = WorkerSpec(device=0, backend=backend, programs=(TINY,), endpoint=endpoint)
    worker = Worker(spec, here)
    client = worker.ctx.socket(zmq.DEALER)

    def serve() -> None:
        worker._main = threading.get_ident()
        worker._serve()

    loop = threading.Thread(target=serve, daemon=True)
    try:
        client.connect(endpoint)
        loop.start()
        yield worker, client
    finally:
        worker._stopping = True
        loop.join(10)
        client.close(0)
        worker.engine.close()
        worker.sock.close(0)
        worker.ctx.destroy(linger=0)
        there.close()


@pytest.mark.parametrize("backend", ["null", "sim"])
def test_a_bundle_is_answered_call_by_call_and_a_bad_call_fails_alone(backend: str) -> None:
    bad = wire.encode_request(
        2, "step", ops.Step("attention", 0, {"actual_seq_lengths_kv": "x"}, outputs=["out"])
    )
    envelopes = [bytes(_request(1)[0]), bytes(bad[0]), bytes(_request(3)[0])]
    with _serving(backend, "inproc://b") as (worker, client):
        client.send(wire.bundle(envelopes))
        messages: list[list[wire.Reply | wire.DecodeError]] = []
        while sum(map(len, messages)) < 3:
            assert client.poll(60_000), "the worker did not answer the whole bundle"
            messages.append(wire.decode_replies(client.recv_multipart()))
        replies = {r.id: r for m in messages for r in m if isinstance(r, wire.Reply)}
        assert sorted(replies) == [1, 2, 3]
        assert _step_done(replies[1]).outputs["out"].shape[0] == 1
        assert _step_done(replies[3]).outputs["out"].shape[0] == 1
        error = replies[2].error
        assert error is not None and error.code == "BAD_REQUEST"
        assert "actual_seq_lengths_kv" in error.message
        assert len(messages) <= 3  # how the replies group depends on when the steps finish
        assert worker.counters["bundles"] == 1 and worker.counters["requests"] == 3


def test_replies_to_a_large_bundle_come_in_bundles_a_client_can_read() -> None:
    """Two thousand status requests in one bundle: their replies (about 1.6 MB in all)
    come back as several bundles, each within the reader's 1 MiB envelope limit."""
    n = 2000
    envelopes = [bytes(wire.encode_request(i + 1, "status", ops.Status())[0]) for i in range(n)]
    with _serving("null", "inproc://big") as (_, client):
        client.send(wire.bundle(envelopes))
        ids: list[int] = []
        sizes: list[int] = []
        while len(ids) < n:
            assert client.poll(60_000), f"{n - len(ids)} replies never came"
            frames = client.recv_multipart()
            sizes.append(len(frames[0]))
            for r in wire.decode_replies(frames):  # default limits: a client's
                assert isinstance(r, wire.Reply) and r.error is None, r
                ids.append(r.id)
        assert sorted(ids) == list(range(1, n + 1))
        assert sum(sizes) > 2**20 and len(sizes) > 1 and max(sizes) <= 64 * 1024
