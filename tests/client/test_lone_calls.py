"""A call alone in its turn of the event loop, made while others are in flight (a
scheduler decoding ahead: one decode sent per reply), goes as itself, without the
bundling of several calls made in one turn (docs/performance.md, "Third session")."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import zmq

from graphlane.client import transport
from graphlane.client.transport import Channel, Sockets, shared_context
from graphlane.protocol import ops, wire


async def test_a_lone_queued_call_goes_as_itself_and_is_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bundled: list[int] = []
    real = wire.bundles

    def counted(envelopes: Any, *args: Any) -> Any:
        bundled.append(len(envelopes))
        return real(envelopes, *args)

    monkeypatch.setattr(transport.wire, "bundles", counted)
    server = shared_context().socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.setsockopt(zmq.RCVTIMEO, 30_000)  # a call never sent fails the test, no hang
    endpoint = "inproc://graphlane-test-lone-calls"
    server.bind(endpoint)
    sockets = Sockets()
    try:
        ch = Channel(sockets, endpoint, "peer", bundle_max=wire.BUNDLE_MAX)
        status = ops.OPS["status"]
        first = asyncio.ensure_future(ch.call(1, status, ops.Status(), 5.0))
        await asyncio.sleep(0)  # sent at once: alone on the connection
        second = asyncio.ensure_future(ch.call(2, status, ops.Status(), 5.0))
        await asyncio.sleep(0)  # queued (the first is in flight), then flushed alone
        await asyncio.sleep(0)
        got = []
        for _ in range(2):
            ident, frame = await asyncio.to_thread(server.recv_multipart)
            env = msgspec.msgpack.decode(frame)
            assert isinstance(env, dict)  # an envelope, not a bundle's array
            got.append(env["id"])
            reply = wire.encode_reply(env["id"], {"ok": True})
            server.send_multipart([ident, *reply])
        assert got == [1, 2]
        assert await first == {"ok": True} and await second == {"ok": True}
        assert bundled == []  # neither went through the bundling of several calls
        ch.close_now()
    finally:
        sockets.close_all()
        server.close(0)
