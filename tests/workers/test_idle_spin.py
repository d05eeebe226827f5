"""An idle worker's poll for its next request (``idle_spin_us``, WorkerLoop._sleep).

The loop polls its socket before it sleeps only when nothing is in flight (no other
thread of the worker needs the interpreter lock the poll holds) and while its waits
have been short; a message or a posted command that comes during the poll ends it at
once; the time polled is the worker's ``spin_seconds`` (a daemon's report of it:
tests/daemon/test_worker_spin.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from graphlane.protocol import wire
from graphlane.workers.loop import WorkerLoop
from graphlane.workers.metrics import WorkerMetrics


class _Handler:
    """Answers nothing: these tests read the loop's waits alone."""

    def answer(self, req: Any, origin: Any) -> None:
        return None

    def refused(self, error: Any, origin: Any) -> None:
        pass


@pytest.fixture
def make_loop() -> Iterator[Callable[..., tuple[WorkerLoop, zmq.Socket[Any]]]]:
    ctx = zmq.Context()
    socks: list[zmq.Socket[Any]] = []

    def make(spin_s: float, idle: Callable[[], bool]) -> tuple[WorkerLoop, zmq.Socket[Any]]:
        endpoint = f"inproc://spin-{len(socks)}"
        router = ctx.socket(zmq.ROUTER)
        router.bind(endpoint)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        socks.extend((router, dealer))
        loop = WorkerLoop(
            router, wire.Codec(), _Handler(), pump=lambda: None, metrics=WorkerMetrics(),
            spin_s=spin_s, idle=idle,
        )  # fmt: skip
        return loop, dealer

    yield make
    for s in socks:
        s.close(0)
    ctx.term()


def _wait(loop: WorkerLoop) -> float:
    """One of the loop's waits (as serve() sleeps, right after the socket said that no
    message waits); its wall seconds."""
    assert not loop.sock.get(zmq.EVENTS) & zmq.POLLIN
    fds: list[Any] = [(loop.sock.FD, wire.POLLIN), (loop._wake_r, wire.POLLIN)]
    t0 = time.perf_counter()
    loop._sleep(fds, loop._wake_r, None)
    return time.perf_counter() - t0


def _later(seconds: float, fn: Callable[[], Any]) -> threading.Thread:
    t = threading.Timer(seconds, fn)
    t.start()
    return t


def test_an_idle_loop_polls_and_a_request_that_comes_meanwhile_ends_the_wait(make_loop) -> None:
    loop, dealer = make_loop(spin_s=2.0, idle=lambda: True)
    t = _later(0.05, lambda: dealer.send(b"request"))
    took = _wait(loop)
    t.join()
    assert took < 1.5  # the poll saw it: not its end, nor the sleep's second
    assert loop.metrics.spin_seconds > 0
    assert loop.sock.get(zmq.EVENTS) & zmq.POLLIN  # left for the next turn to take


def test_a_loop_with_work_in_flight_sleeps_at_once(make_loop) -> None:
    loop, _ = make_loop(spin_s=2.0, idle=lambda: False)
    ran: list[int] = []
    t = _later(0.05, lambda: loop.post(lambda: ran.append(1)))
    _wait(loop)
    t.join()
    assert ran == [1]  # woken by the posted command
    assert loop.metrics.spin_seconds == 0.0  # the engine's threads had the lock


def test_long_waits_stop_the_poll_and_short_ones_bring_it_back(make_loop) -> None:
    spin = 0.02
    loop, _ = make_loop(spin_s=spin, idle=lambda: True)

    def long_wait() -> float:
        """A wait that ends long after the poll's end: its spin_seconds"""
        before = loop.metrics.spin_seconds
        t = _later(6 * spin, lambda: loop.post(lambda: None))
        _wait(loop)
        t.join()
        return loop.metrics.spin_seconds - before

    # Each of the first five is polled for (at least half of the last 8 were short)...
    assert all(long_wait() > 0 for _ in range(5))
    # ... then the poll is not worth its CPU: the loop sleeps at once.
    assert long_wait() == 0.0
    assert long_wait() == 0.0
    for _ in range(4):  # a client that answers at once again: a command already posted
        loop.post(lambda: None)
        _wait(loop)
    assert long_wait() > 0
