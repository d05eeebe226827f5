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

Binds: ipc endpoints and loopback tcp are allowed without authentication; any
other tcp bind is refused unless authentication is configured or ``insecure``
is set.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth


class SecurityError(ValueError):
    """A key or bind setting that cannot be used; the message names the setting."""


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    clients_dir: str

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
        return cls(public, secret, str(clients))

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server (before bind)."""
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_server = True


def start_authenticator(ctx: zmq.Context[Any], keys: ServerKeys) -> Any:
    """ZAP handler of ``ctx`` (in its own thread, so it exists before any bind): admits
    CURVE clients whose public keys are in clients_dir. Call ``.stop()`` at shutdown."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
    auth.start()
    auth.configure_curve(domain="*", location=keys.clients_dir)
    return auth


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
