"""CurveZMQ authentication and encryption, shared by the daemon, workers and clients.

Key files are ZeroMQ's certificate format (``zmq.auth.create_certificates``):
``NAME.key`` holds the public key, ``NAME.key_secret`` the keypair.

- ``graphlane keys generate DIR --name NAME`` writes DIR/NAME.key and DIR/NAME.key_secret;
- ``graphlane serve --auth-dir DIR`` serves with DIR/server.key_secret and admits
  only clients whose public keys (``*.key``) are in DIR/clients/;
- ``Client(endpoint, server_key=DIR/server.key, client_key=DIR/NAME.key_secret)``.

A client whose key is not admitted gets no service and no reply: the server
drops the handshake. The client's own socket monitor sees the failed
handshake and fails its calls with UNAUTHORIZED instead of waiting for them to
time out.

Roles (docs/security.md): once CURVE has admitted a key, :class:`Roles` says what it
may do. Keys are named by their files, ``clients/NAME.key``; the config's top-level
``admin_keys`` names the keys that may ``drain`` and ``shutdown``, a program's
``clients`` the keys that may use it and its device state. Without those settings every
admitted key may do everything; without authentication there are no keys, and no roles.
A refused request is answered FORBIDDEN. The server learns the sender from the ZAP
User-Id of the message: pyzmq's authenticator sets it to the client's public key (Z85).

Binds: ipc endpoints and loopback tcp are allowed without authentication; any
other tcp bind is refused unless authentication is configured or ``insecure``
is set. An ipc socket is its owner's only (:func:`bind`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from graphlane.protocol import wire
from graphlane.protocol.errors import Forbidden


class SecurityError(ValueError):
    """A key or bind setting that cannot be used; the message names the setting."""


@dataclass(frozen=True)
class ServerKeys:
    """The server's keypair and the admitted client keys, read once (when the daemon
    starts) and handed to every worker it spawns: every socket of a daemon's life admits
    the same keys, however ``clients/`` changes meanwhile."""

    public: bytes
    secret: bytes
    clients_dir: str
    #: the admitted keys by name: NAME of each clients/NAME.key -> its public key (Z85)
    clients: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, auth_dir: str | os.PathLike[str]) -> ServerKeys:
        d = Path(auth_dir)
        secret_file = d / "server.key_secret"
        if not secret_file.exists():
            raise SecurityError(
                f"--auth-dir: {secret_file} does not exist "
                f"(graphlane keys generate {d} --name server)"
            )
        clients = d / "clients"
        if not clients.is_dir():
            raise SecurityError(
                f"--auth-dir: {clients}/ does not exist; put admitted clients' NAME.key files there"
            )
        public, secret = zmq.auth.load_certificate(str(secret_file))
        if secret is None:
            raise SecurityError(f"--auth-dir: {secret_file} holds no secret key")
        return cls(public, secret, str(clients), client_keys(clients))

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server (before bind)."""
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_server = True


def start_authenticator(ctx: zmq.Context[Any], keys: ServerKeys) -> Any:
    """ZAP handler of ``ctx`` (in its own thread, so it exists before any bind): admits
    the CURVE clients of ``keys.clients`` (as read when the keys were loaded; the
    directory is not read again). Call ``.stop()`` at shutdown."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
    auth.start()
    auth.configure_curve_callback("*", _Admitted(keys.clients.values()))
    return auth


class _Admitted:
    """pyzmq's credentials provider over a fixed set of public keys (Z85)."""

    def __init__(self, keys: Any) -> None:
        self.keys = frozenset(k.encode("ascii") for k in keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def client_keys(clients_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The admitted keys by name: NAME of each ``clients_dir/NAME.key`` -> its public key
    (Z85, as the ZAP User-Id of that client's messages)."""
    out = {}
    for path in sorted(Path(clients_dir).glob("*.key")):
        public, _ = zmq.auth.load_certificate(str(path))
        out[path.stem] = public.decode("ascii")
    return out


#: Operations that act on the whole daemon or a whole worker, not on one program.
ADMIN_OPS = frozenset({"drain", "shutdown"})


@dataclass(frozen=True)
class Roles:
    """What each admitted key may do (see the module docstring). Built once at start from
    the config's key names; the servers check every request against it."""

    names: dict[str, str]  # public key (Z85) -> key name, for the messages
    admins: frozenset[str] | None  # public keys; None: every admitted key
    programs: dict[str, frozenset[str]] = field(default_factory=dict)  # absent: every key

    @classmethod
    def load(
        cls,
        server: ServerKeys,
        admin_keys: Sequence[str] | None,
        program_clients: Mapping[str, Sequence[str]],
    ) -> Roles | None:
        """None when the config names no roles (every admitted key may do everything)."""
        if admin_keys is None and not program_clients:
            return None
        by_name, clients_dir = server.clients, server.clients_dir

        def keys(setting: str, names: Sequence[str]) -> frozenset[str]:
            for name in names:
                if name not in by_name:
                    raise SecurityError(
                        f"{setting}: no client key named {name!r} "
                        f"({Path(clients_dir) / name}.key does not exist)"
                    )
            return frozenset(by_name[n] for n in names)

        return cls(
            names={key: name for name, key in by_name.items()},
            admins=None if admin_keys is None else keys("admin_keys", admin_keys),
            programs={p: keys(f"{p}.clients", n) for p, n in program_clients.items()},
        )

    def check(self, sender: str | None, op: str, program: str | None = None) -> None:
        """FORBIDDEN unless the key ``sender`` (a ZAP User-Id) may make request ``op``
        (to ``program``, for a program's operations)."""
        if op in ADMIN_OPS:
            if self.admins is not None and sender not in self.admins:
                raise Forbidden(f"{op} needs a key named in admin_keys; {self._who(sender)} is not")
            return
        allowed = self.programs.get(program) if program is not None else None
        if allowed is not None and sender not in allowed:
            raise Forbidden(
                f"program {program!r} serves only the keys its clients setting names; "
                f"{self._who(sender)} is not one of them"
            )

    def _who(self, sender: str | None) -> str:
        name = self.names.get(sender) if sender is not None else None
        return f"key {name!r}" if name else "this key"


def sender_of(frame: zmq.Frame) -> str | None:
    """The ZAP User-Id of the message ``frame`` belongs to (with CurveZMQ: the sender's
    public key, Z85); None for a message that came without ZAP."""
    try:
        sender = frame.get("User-Id")
    except zmq.ZMQError:  # no such property
        return None
    return sender if isinstance(sender, str) else None


def recv_with_source(
    sock: zmq.Socket[Any], copied: int, flags: int = 0, keep: int = 1 << 62
) -> tuple[list[Any], zmq.Frame]:
    """:func:`~graphlane.protocol.wire.recv_message` of a ROUTER socket (``keep`` frames at
    most, the routing id included), and its routing id as a Frame, which carries the
    message's properties: the sender's key (:func:`sender_of`), the descriptor it came in
    on (``zmq.SRCFD``)."""
    first = sock.recv(flags, copy=False)
    if first.more:
        frames = [first.bytes, *wire.recv_message(sock, copied - 1, 0, keep - 1)]
    else:
        frames = [first.bytes]
    return frames, first


@dataclass(frozen=True)
class ClientKeys:
    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, server_key: str | bytes, client_key: str | bytes) -> ClientKeys:
        server_public = _public_of(server_key, "server_key")
        public, secret = _keypair_of(client_key, "client_key")
        return cls(server_public, public, secret)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def _public_of(key: str | bytes, name: str) -> bytes:
    if isinstance(key, bytes) and len(key) == 40:
        return key  # a Z85 public key
    path = Path(os.fsdecode(key))
    if not path.exists():
        raise SecurityError(f"{name}: {path} does not exist")
    public, _ = zmq.auth.load_certificate(str(path))
    return public


def _keypair_of(key: str | bytes, name: str) -> tuple[bytes, bytes]:
    path = Path(os.fsdecode(key))
    if not path.exists():
        raise SecurityError(f"{name}: {path} does not exist")
    public, secret = zmq.auth.load_certificate(str(path))
    if secret is None:
        raise SecurityError(f"{name}: {path} holds no secret key (use NAME.key_secret)")
    return public, secret


def generate(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write DIR/NAME.key and DIR/NAME.key_secret (the secret readable by the owner only)."""
    if not name or "/" in name or name.startswith("."):
        raise SecurityError(f"--name: {name!r} is not a usable key name")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = (d / f"{name}.key", d / f"{name}.key_secret")
    if public.exists() or secret.exists():
        raise SecurityError(f"{public} or {secret} exists already; not overwriting keys")
    pub, sec = zmq.auth.create_certificates(str(d), name)
    os.chmod(sec, 0o600)
    return Path(pub), Path(sec)


def bind(sock: zmq.Socket[Any], endpoint: str) -> None:
    """``sock.bind(endpoint)``; an ipc socket file is made its owner's only: created with
    umask 077 (``srwx------``: another user may not connect, whatever the umask and the
    directory's mode), in a directory no other user may replace it in (see
    :func:`check_ipc_directory`). The daemon and its workers bind through this."""
    if not endpoint.startswith("ipc://"):
        sock.bind(endpoint)
        return
    path = endpoint[len("ipc://") :]
    check_ipc_directory(os.path.dirname(path) or ".", endpoint)
    umask = os.umask(0o077)  # the process's: nothing else here creates files meanwhile
    try:
        sock.bind(endpoint)  # libzmq creates the socket file in this call
    finally:
        os.umask(umask)
    os.chmod(path, 0o700)  # the file is ours: make sure, whatever made it


def check_ipc_directory(directory: str, endpoint: str) -> None:
    """SecurityError unless ``directory`` belongs to this process's user (or root) and no
    other user may write in it, or it has the sticky bit (as /tmp): elsewhere another
    user could remove the socket and put their own in its place."""
    try:
        st = os.stat(directory)
    except OSError as exc:
        raise SecurityError(f"listen: {endpoint}: its directory: {exc.strerror}") from None
    owner = st.st_uid
    if owner not in (os.geteuid(), 0):
        raise SecurityError(
            f"listen: {endpoint}: its directory {directory} belongs to another user "
            f"(uid {owner}); use a directory of your own, e.g. /run/graphlane"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise SecurityError(
            f"listen: {endpoint}: its directory {directory} is writable by other users "
            f"(mode {stat.S_IMODE(st.st_mode):o}), who could replace the socket; "
            f"use a directory only you may write (chmod go-w {directory})"
        )


def check_bind(endpoint: str, authenticated: bool, insecure: bool) -> None:
    """Refuse a tcp bind reachable from other hosts without authentication."""
    if not endpoint.startswith("tcp://") or authenticated or insecure:
        return
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    if host in ("localhost",):
        return
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            addresses = [ipaddress.ip_address(a[4][0]) for a in socket.getaddrinfo(host, None)]
        except OSError:
            addresses = []
    if host == "*" or not addresses or not all(a.is_loopback for a in addresses):
        raise SecurityError(
            f"listen: {endpoint} accepts connections from other hosts; configure CurveZMQ "
            "authentication (--auth-dir) or pass --insecure to serve it unauthenticated"
        )
