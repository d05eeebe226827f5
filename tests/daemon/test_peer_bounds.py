"""What one peer can make a server hold: frames, bytes, unread replies (docs/security.md,
"Bounds").

Memory is measured as the server process's resident set (``VmRSS``) and its peak
(``VmHWM``, reset through ``/proc/PID/clear_refs`` before each measurement), always
against a baseline taken in the same run; no assertion is on time.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import Any

import pytest
import torch
import zmq
from daemons import finish, free_port, serve_until_ready, write_config

from graphlane.client import SyncClient
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

    def __init__(self, endpoint: str, reads: bool = True) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if not reads:  # a reader that takes nothing: its own side queues next to nothing
            self.sock.setsockopt(zmq.RCVHWM, 1)
            self.sock.setsockopt(zmq.RCVBUF, 4096)
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


class Zmtp:
    """A DEALER peer speaking ZMTP 3.0 (NULL security) on a raw socket: it sends each
    frame as it is given, whole message or not (rfc.zeromq.org/spec/23)."""

    def __init__(self, endpoint: str) -> None:
        if endpoint.startswith("ipc://"):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(endpoint[len("ipc://") :])
        else:
            host, port = endpoint[len("tcp://") :].rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)))
        greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
        self.sock.sendall(greeting + b"\0" + b"\0" * 31)
        self._read(64)  # the server's greeting
        ready = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
        self.sock.sendall(b"\x04" + bytes((len(ready),)) + ready)
        flags, size = self._header()
        assert flags & 0x04, "the server's READY"
        self._read(size)

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            assert chunk, "the server closed the connection"
            out += chunk
        return out

    def _header(self) -> tuple[int, int]:
        flags = self._read(1)[0]
        size = int.from_bytes(self._read(8 if flags & 0x02 else 1), "big")
        return flags, size

    def frame(self, data: bytes, more: bool = False) -> None:
        flags = 0x01 if more else 0
        if len(data) > 255:
            head = bytes((flags | 0x02,)) + len(data).to_bytes(8, "big")
        else:
            head = bytes((flags, len(data)))
        self.sock.sendall(head + data)

    def reply_error(self, request_id: int) -> Any:
        """The code of the (one-frame) reply to ``request_id``; None if it is ok."""
        self.sock.settimeout(60)
        _, size = self._header()
        (reply,) = wire.decode_replies([self._read(size)])
        assert isinstance(reply, wire.Reply) and reply.id == request_id, reply
        return None if reply.error is None else reply.error.code

    def close(self) -> None:
        self.sock.close()


def worker_status(d: Any, *keys: str) -> dict[str, Any]:
    """The worker's own status (what the daemon's does not relay), or ``keys`` of it; by
    default its unread reply bytes and memory releases. Asked on a connection of its own:
    one request, one reply."""
    peer = Peer(d.worker(0)["endpoint"])
    try:
        peer.sock.send_multipart(list(wire.encode_request(1, "status", ops.Status())))
        body = peer.reply().body(ops.OPS["status"])
        return {k: body[k] for k in keys or ("unread_reply_bytes", "memory_releases")}
    finally:
        peer.close()


def answered_since(d: Any) -> Any:
    """A reader of how many requests the worker has answered (an ok reply or an error)
    since this call, by its own counters; its own status requests are not counted. The
    daemon's ``inflight`` and ``queued`` will not do: they are the worker's last report
    to the daemon (about once a second), so right after a burst they still say that
    nothing is open."""
    start = worker_status(d, "counters")["counters"]
    reads = 0

    def answered() -> int:
        nonlocal reads
        reads += 1  # the status requests answered before this one's: one per read
        now = worker_status(d, "counters")["counters"]
        return now["replies"] + now["errors"] - start["replies"] - start["errors"] - reads

    return answered


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


# A paged KV cache whose full read is a 4 MiB reply: 2048 slots of 2 KiB (key and value).
BIG_PAGED = {"name": "paged_attention", "layers": 2, "num_heads": 4, "num_kv_heads": 2,
             "head_dim": 128, "block_size": 128, "num_blocks": 16, "max_blocks_per_seq": 2,
             "buckets": [1]}  # fmt: skip
READ_BYTES = 4 * MiB
BOUND = 32 * MiB


def kv_read(request_id: int, generation: int) -> list[Any]:
    slots = torch.arange(BIG_PAGED["num_blocks"] * BIG_PAGED["block_size"])
    body = ops.KvRead(program="paged_attention", device=0, slots=slots, generation=generation)
    return list(wire.encode_request(request_id, "kv_read", body))


def wait_for_value(read: Any, ok: Any, limit_s: float, what: str, explain: Any = dict) -> Any:
    """``read()`` once ``ok`` of it, polled until ``limit_s``; else fail saying ``what``
    it still is, and ``explain()``."""
    deadline = time.monotonic() + limit_s
    while True:
        value = read()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: still {value} after {limit_s} s ({explain()})")
        time.sleep(0.05)


def test_a_client_that_reads_no_reply_holds_a_bounded_amount_and_frees_it(start_daemon) -> None:
    """Issue 40 (4): 120 kv_read replies of 16 MiB to a client that never read them made
    the worker hold 2 GiB for one connection, 1.37 GiB still after it closed. Now a
    connection's unread replies are counted (pyzmq trackers): past
    max_unread_reply_bytes its device requests are refused BUSY and its further data
    replies replaced by a BUSY error (not retryable), so the worker grows by about the
    bound; once the peer goes, libzmq drops its replies and the worker gives their
    memory back. Another client's KV is exact throughout, and the peer, once it reads,
    is served again."""
    d = start_daemon(devices=1, programs=[BIG_PAGED], max_unread_reply_bytes=BOUND)
    pid, generation = d.worker(0)["pid"], d.worker(0)["generation"]
    layers, heads, dim = BIG_PAGED["layers"], BIG_PAGED["num_kv_heads"], BIG_PAGED["head_dim"]
    gen = torch.Generator().manual_seed(40)
    key = torch.randn((layers, 8, heads, dim), generator=gen).to(torch.float16)
    value = torch.randn((layers, 8, heads, dim), generator=gen).to(torch.float16)
    mine = list(range(100, 108))
    with SyncClient(d.endpoint, timeout=60) as other:
        other.kv_write("paged_attention", 0, mine, key, value)
        for _ in range(2):  # the worker's path of a full read warmed up
            other.kv_read("paged_attention", 0, torch.arange(BIG_PAGED["num_blocks"] * 128))
        baseline, _ = rss(pid)
        peer = Peer(d.worker(0)["endpoint"], reads=False)
        try:
            reads = 40  # 160 MiB of replies, five times the bound
            answered = answered_since(d)
            for i in range(reads):
                peer.sock.send_multipart(kv_read(1000 + i, generation))
            # Every request is answered (each reply is queued or replaced): the worker's
            # counters say so, without the peer reading anything.
            wait_for_value(
                answered, lambda n: n >= reads, 60, "the peer's requests answered",
                lambda: worker_status(d, "inflight", "queued"),
            )  # fmt: skip
            # What it held for the replies it dropped goes back within a second or so.
            wait_for_value(
                lambda: rss(pid)[0] - baseline, lambda grown: grown < BOUND + 4 * READ_BYTES, 20,
                "the worker's growth while the peer reads nothing (bytes)",
                lambda: worker_status(d),
            )  # fmt: skip
            back = other.kv_read("paged_attention", 0, mine)  # served while the peer is not
            assert torch.equal(back.outputs["key"], key)
            assert torch.equal(back.outputs["value"], value)
            codes = [peer.reply().error for _ in range(reads)]
            refused = [e for e in codes if e is not None]
            assert refused and all(e.code == ErrorCode.BUSY for e in refused), refused
            assert reads - len(refused) <= BOUND // READ_BYTES + 1
            # Read up, the peer is served again.
            peer.sock.send_multipart(kv_read(2000, generation))
            assert peer.reply().error is None
            # Now it leaves replies unread again, and goes.
            answered = answered_since(d)
            for i in range(reads):
                peer.sock.send_multipart(kv_read(3000 + i, generation))
            wait_for_value(
                answered, lambda n: n >= reads, 60, "the peer's requests answered",
                lambda: worker_status(d, "inflight", "queued"),
            )  # fmt: skip
        finally:
            peer.close()
        wait_for_value(
            lambda: rss(pid)[0] - baseline, lambda grown: grown < BOUND // 4, 30,
            "the worker's growth once the peer went (bytes)", lambda: worker_status(d),
        )  # fmt: skip
        back = other.kv_read("paged_attention", 0, mine)
        assert torch.equal(back.outputs["key"], key)
        assert torch.equal(back.outputs["value"], value)
    assert d.worker(0)["pid"] == pid


def test_a_worker_killed_while_the_daemon_has_no_file_descriptor_left_comes_back(
    tmp_path,
) -> None:
    """Issue 40 (5): with idle connections filling the daemon's file descriptors and
    its worker killed, the restart died with EMFILE ("Task exception was never
    retrieved") and the worker stayed ``starting`` for good, even once the connections
    closed. A start the system refuses (any OSError) is now retried with backoff, so
    the worker is back, with a new generation, once descriptors are free again. The
    daemon runs with a low RLIMIT_NOFILE (set in its own process, before it starts)."""
    limit = 64
    wrapper = (
        "import resource, runpy, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
        "sys.argv[0] = 'graphlane'; runpy.run_module('graphlane', run_name='__main__')"
    )
    listen = f"tcp://127.0.0.1:{free_port(2)}"
    config = write_config(tmp_path / "fd.toml", {"listen": listen, "devices": 1})
    argv = [sys.executable, "-c", wrapper, "serve", "--config", str(config)]
    d = serve_until_ready(tmp_path, "fd", argv)
    try:
        before = d.worker(0)
        host, port = listen[len("tcp://") :].rsplit(":", 1)
        idle = [socket.create_connection((host, int(port))) for _ in range(limit + 16)]
        try:
            os.kill(before["pid"], signal.SIGKILL)
            wait_for_value(
                lambda: d.log(), lambda text: "cannot start a worker process" in text, 60,
                "the daemon's log",
            )  # fmt: skip
        finally:
            for s in idle:
                s.close()
        after = wait_for_value(
            lambda: d.worker(0), lambda w: w["state"] == "ready", 60, "the worker",
        )  # fmt: skip
        assert after["pid"] != before["pid"] and after["generation"] != before["generation"]
        assert "Task exception was never retrieved" not in d.log()
    finally:
        finish(d)


@pytest.mark.parametrize(
    ("socket", "frames", "size"),
    [("daemon", 24, 4 * MiB), ("worker", 17, 16 * MiB)],  # each frame at its MAXMSGSIZE or under
)
def test_a_message_still_arriving_holds_its_frames_until_it_ends_then_they_go(
    shared_daemon, socket: str, frames: int, size: int
) -> None:
    """Issue 40 (3): libzmq hands a message over only once it is whole, and bounds a
    frame (ZMQ_MAXMSGSIZE), not their count: a message still arriving holds every
    frame received so far, in libzmq, for as long as its peer takes (docs/security.md
    states the figure). What graphlane bounds is what follows: once the message ends
    it is refused TOO_LARGE, and the memory goes back to the kernel (the daemon kept
    640 MiB of a 161-frame message after refusing it)."""
    d = shared_daemon(devices=1)
    endpoint, pid = endpoints(d)[socket]
    peer = Peer(endpoint)
    try:
        baseline, _ = rss(pid)
        sent = frames * size
        # libzmq's own sender keeps a message until it is whole: a peer that means harm
        # speaks ZMTP itself and sends the frames of one it never ends.
        raw = Zmtp(endpoint)
        raw.frame(wire.encode_request(5, "status", ops.Status())[0], more=True)
        for _ in range(frames):
            raw.frame(b"\0" * size, more=True)
        held = wait_for_value(
            lambda: rss(pid)[0] - baseline, lambda grown: grown > sent * 0.9, 60,
            "the server's growth while the message arrives (bytes)",
        )  # fmt: skip
        assert held < sent * 1.5
        raw.frame(b"")  # the message ends: refused, its memory given back
        assert raw.reply_error(5) == ErrorCode.TOO_LARGE
        wait_for_value(
            # (a worker keeps about three of its frames' pages: glibc's, not understood)
            lambda: rss(pid)[0] - baseline, lambda grown: grown < 4 * size, 30,
            "the server's growth once the message was refused (bytes)",
        )  # fmt: skip
        raw.close()
        peer.sock.send_multipart(list(wire.encode_request(6, "status", ops.Status())))
        assert peer.reply().error is None
    finally:
        peer.close()
