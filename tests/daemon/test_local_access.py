"""What docs/security.md claims of local access holds (issue 40, 8).

- An ipc socket is its owner's only: with umask 0 the daemon's and the workers' sockets
  were 0777 (in a directory others could enter, another local user shut the daemon
  down); a directory other users may write is refused, naming it.
- The admitted keys are read once, when the daemon starts: a worker restarted after a
  key was added to ``clients/`` admitted that key (the daemon refused it).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from daemons import RunningDaemon, wait_for

from graphlane.protocol import ops, wire


def test_ipc_sockets_are_their_owners_only_whatever_the_umask(start_daemon: Any, tmp_path: Path):
    umask = os.umask(0)
    try:
        d: RunningDaemon = start_daemon("ipc", devices=2, backend="null")
    finally:
        os.umask(umask)
    sockets = sorted((tmp_path / "daemon0").glob("*.sock"))
    assert len(sockets) == 3, sockets  # the daemon's and two workers'
    for path in sockets:
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, (path, oct(path.stat().st_mode))
    assert d.status()["state"] == "running"


def test_an_ipc_directory_other_users_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone may remove the socket and put another there
    listen = f"ipc://{shared}/daemon.sock"
    cmd = [sys.executable, "-m", "graphlane", "serve", "--listen", listen, "--backend", "null"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "writable by other users" in out.stderr and str(shared) in out.stderr
    assert not (shared / "daemon.sock").exists()


def _answers(endpoint: str, server_public: bytes, client_secret_file: Path) -> bool:
    """Whether the worker at ``endpoint`` answers a status from this client key (a key
    that is not admitted gets no reply: its handshake is dropped)."""
    public, secret = zmq.auth.load_certificate(str(client_secret_file))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            server_public,
            public,
            secret,
        )
        sock.connect(endpoint)
        sock.send_multipart(list(wire.encode_request(1, "status", ops.Status())))
        return bool(sock.poll(5000))
    finally:
        sock.close(0)
        ctx.term()


def test_a_restarted_worker_admits_the_keys_the_daemon_read_when_it_started(
    start_daemon: Any, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    cli = [sys.executable, "-m", "graphlane", "keys", "generate"]
    for where, name in ((keys, "server"), (keys / "clients", "sched"), (tmp_path, "late")):
        subprocess.run([*cli, str(where), "--name", name], check=True, capture_output=True)
    admitted = {
        "server_key": str(keys / "server.key"),
        "client_key": str(keys / "clients" / "sched.key_secret"),
    }
    d = start_daemon("tcp", devices=1, backend="null", client_keys=admitted, auth_dir=str(keys))
    server_public, _ = zmq.auth.load_certificate(str(keys / "server.key"))
    first = d.worker(0)
    # A key added to clients/ after the start, then the worker restarts.
    (keys / "clients" / "late.key").write_bytes((tmp_path / "late.key").read_bytes())
    os.kill(first["pid"], signal.SIGKILL)
    w = wait_for(
        lambda: (w := d.worker(0))["pid"] != first["pid"] and w["state"] == "ready" and w,
        120,
        "the killed worker to be replaced",
    )
    assert _answers(w["endpoint"], server_public, keys / "clients" / "sched.key_secret")
    assert not _answers(w["endpoint"], server_public, tmp_path / "late.key_secret")
    assert not _answers(d.endpoint, server_public, tmp_path / "late.key_secret")
