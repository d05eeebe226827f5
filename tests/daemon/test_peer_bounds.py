"""What one peer can make a server hold: frames, bytes, unread replies (docs/security.md,
"Bounds").

Memory is measured as the server process's resident set (``VmRSS``) and its peak
(``VmHWM``, reset through ``/proc/PID/clear_refs`` before each measurement), always
against a baseline taken in the same run; no assertion is on time.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import zmq

from graphlane.protocol import ErrorCode, ops, wire

MiB = 2**20
#: What libzmq itself holds per queued frame (a zmq_msg_t): the part of a message a
#: receiver cannot refuse before it arrives whole.
LIBZMQ_FRAME_BYTES = 64


def rss(pid: int) -> tuple[int, int]:
    """``pid``'s resident set and its peak since the last :func:`reset_peak`, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out["VmRSS"], out["VmHWM"]


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


class Peer:
    """One raw DEALER connection (what any peer may send, frame by frame)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def send_frames(self, request_id: int, extra: int, size: int = 0) -> None:
        """A status request followed by ``extra`` frames of ``size`` bytes, as one message."""
        send = self.sock.send
        send(wire.encode_request(request_id, "status", ops.Status())[0], zmq.SNDMORE)
        frame = b"\0" * size
        for _ in range(extra - 1):
            send(frame, zmq.SNDMORE, copy=False)
        send(frame, copy=False)

    def reply(self, wait_s: float = 60) -> wire.Reply:
        assert self.sock.poll(int(wait_s * 1000)), f"no reply within {wait_s} s"
        (reply,) = wire.decode_replies(self.sock.recv_multipart())
        assert isinstance(reply, wire.Reply)
        return reply


def endpoints(d: Any) -> dict[str, tuple[str, int]]:
    w = d.worker(0)
    return {"worker": (w["endpoint"], w["pid"]), "daemon": (d.endpoint, d.proc.pid)}


@pytest.mark.parametrize("socket", ["worker", "daemon"])
def test_a_message_of_many_frames_costs_what_libzmq_holds_and_no_more(
    shared_daemon, socket: str
) -> None:
    """Issue 40 (2): a message of 300,000 empty frames was read whole, a Python object
    per frame, before its count was checked (3 s of CPU and 260 MB per million frames:
    3,000,000 made a worker deaf until it was killed as hung). Now a server keeps one
    frame over its limit and drops the others as it reads them: the message is answered
    TOO_LARGE, the peak memory it costs is what libzmq held while it arrived (a
    zmq_msg_t per frame), and the connection serves on."""
    d = shared_daemon(devices=1)
    endpoint, pid = endpoints(d)[socket]
    peer = Peer(endpoint)
    frames = 300_000
    try:
        for request_id, extra in ((1, 65), (2, frames)):
            reset_peak(pid)
            before, _ = rss(pid)
            peer.send_frames(request_id, extra)
            reply = peer.reply()
            assert reply.id == request_id and reply.error is not None
            assert reply.error.code == ErrorCode.TOO_LARGE
        grown = rss(pid)[1] - before
        assert grown < 2 * LIBZMQ_FRAME_BYTES * frames, f"{grown / frames:.0f} bytes per frame"
        peer.sock.send_multipart(list(wire.encode_request(3, "status", ops.Status())))
        assert peer.reply().error is None
    finally:
        peer.close()
    assert os.path.exists(f"/proc/{pid}")
