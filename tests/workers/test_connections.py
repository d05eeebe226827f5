"""Connections (graphlane/workers/connections.py): a watched routing id is reported gone
when its own connection closes, not when another one on a reused descriptor does."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import zmq

from graphlane.workers.connections import Connections


def _until(cond: Any, conns: Connections, limit_s: float = 10) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        conns.monitor.poll(50)
        conns.take_events()


def test_a_watched_connection_is_gone_when_it_closes_and_only_then(tmp_path: Path) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/r.sock"
    router.bind(endpoint)
    gone: list[bytes] = []
    conns = Connections(router, gone.append)

    def connect() -> tuple[zmq.Socket[Any], bytes, zmq.Frame]:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        s.send(b"x")
        assert router.poll(10_000)
        source = router.recv(copy=False)
        router.recv()
        return s, source.bytes, source

    try:
        for _ in range(20):  # descriptors are reused: each connection is told apart
            a, ident_a, src_a = connect()
            b, ident_b, src_b = connect()
            assert conns.watch(ident_a, src_a) and conns.watch(ident_b, src_b)
            assert conns.watched == 2
            a.close(0)
            _until(lambda: len(gone) == 1, conns)
            assert gone == [ident_a]
            c, ident_c, src_c = connect()  # may take a's descriptor
            assert conns.watch(ident_c, src_c)
            b.close(0)
            c.close(0)
            _until(lambda: len(gone) == 3, conns)
            assert sorted(gone) == sorted([ident_a, ident_b, ident_c]) and conns.watched == 0
            gone.clear()
        closed = conns._closed.values
        before = sum(closed())
        d, ident_d, src_d = connect()
        d.close(0)
        _until(lambda: sum(closed()) == before + 1, conns)
        assert not conns.watch(ident_d, src_d)  # closed already: nothing to keep
        assert conns.watched == 0 and not gone
    finally:
        conns.close()
        router.close(0)
        ctx.term()
