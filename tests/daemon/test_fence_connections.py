"""The ordering fence is per connection and goes with it (issue 40, 6).

A connection whose state change was refused has its later requests to stateful
programs refused until it sends ``resume`` (docs/programs.md, "Ordering and
retries"). The worker kept those entries in a table of 4096 that forgot its oldest:
4096 other connections' refusals later, the victim's next request was served, on
device state its refused write never made; and entries of closed connections were
never removed. Now an entry lives exactly as long as its connection.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
import zmq
from daemons import RunningDaemon, wait_for
from test_paged_state import PAGED

from graphlane.protocol import ops, wire

#: A kv_write whose body does not decode: refused (BAD_REQUEST), so it fences.
BAD_WRITE = msgpack.packb({"v": 1, "id": 1, "op": "kv_write", "body": {"program": PAGED["name"]}})


def _reply(sock: zmq.Socket[Any], request_id: int) -> wire.Reply:
    assert sock.poll(30_000), f"no reply to {request_id}"
    while True:
        for r in wire.decode_replies(sock.recv_multipart()):
            assert isinstance(r, wire.Reply)
            if r.id == request_id:
                return r
        assert sock.poll(30_000), f"no reply to {request_id}"


def _code(reply: wire.Reply) -> str | None:
    return None if reply.error is None else str(reply.error.code)


def _fenced(ctx: zmq.Context[Any], endpoint: str) -> int:
    """The worker's count of fenced connections, asked on a connection of its own."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(list(wire.encode_request(9, "status", ops.Status())))
        return int(_reply(sock, 9).body(ops.OPS["status"])["fenced"])
    finally:
        sock.close(0)


def test_a_refused_connection_stays_fenced_whatever_others_do_and_entries_go_with_connections(
    start_daemon: Any,
) -> None:
    d: RunningDaemon = start_daemon(devices=1, programs=[PAGED])
    w = d.worker(0)
    endpoint, generation = w["endpoint"], w["generation"]
    read = ops.KvRead(PAGED["name"], 0, torch.tensor([0, 1]), generation=generation)
    ctx = zmq.Context()
    victim = ctx.socket(zmq.DEALER)
    victim.setsockopt(zmq.LINGER, 0)
    victim.connect(endpoint)
    try:
        victim.send(BAD_WRITE)
        assert _code(_reply(victim, 1)) == "BAD_REQUEST"
        victim.send_multipart(list(wire.encode_request(2, "kv_read", read)))
        assert _code(_reply(victim, 2)) == "PREDECESSOR_FAILED"
        # More refused connections than the table that forgot used to hold, each closed.
        for _ in range(42):
            others = [ctx.socket(zmq.DEALER) for _ in range(100)]
            for s in others:
                s.setsockopt(zmq.LINGER, 0)
                s.connect(endpoint)
                s.send(BAD_WRITE)
            for s in others:
                assert _code(_reply(s, 1)) == "BAD_REQUEST"
                s.close(0)
        victim.send_multipart(list(wire.encode_request(3, "kv_read", read)))
        assert _code(_reply(victim, 3)) == "PREDECESSOR_FAILED"  # not forgotten
        # The closed connections' entries are gone; the victim's stays while it is open.
        wait_for(lambda: _fenced(ctx, endpoint) == 1, 60, "the closed connections' fences to go")
        victim.send_multipart(list(wire.encode_request(4, "resume", ops.Resume(0))))
        assert _reply(victim, 4).error is None
        victim.send_multipart(list(wire.encode_request(5, "kv_read", read)))
        assert _code(_reply(victim, 5)) is None
        victim.send(BAD_WRITE)  # fenced again, then the connection goes
        assert _code(_reply(victim, 1)) == "BAD_REQUEST"
        assert _fenced(ctx, endpoint) == 1
    finally:
        victim.close(0)
    wait_for(lambda: _fenced(ctx, endpoint) == 0, 60, "the victim's fence to go with it")
    ctx.term()
