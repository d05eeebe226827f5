"""ZeroMQ endpoints, checked before any socket exists.

libzmq answers a malformed endpoint with ``EINVAL`` only after a socket was made
for it, and a socket left open by that failure keeps its context from ever
terminating. Every endpoint a user gives (``Client``, ``--connect``,
``--listen``, the config's ``listen``) goes through :func:`check_endpoint`
first, which names the expected forms::

    tcp://HOST:PORT      e.g. tcp://127.0.0.1:7450, tcp://[::1]:7450, tcp://node-3:7450
    ipc://PATH           e.g. ipc:///run/graphlane/daemon.sock
    inproc://NAME        same process only (tests)

A bind (``listen``) may also use ``*`` for HOST, and ``0`` or ``*`` for PORT: any free
port (the daemon logs the one it got and ``graphlane status`` shows it; its workers
then take free ports of their own). A connect needs a port from 1 to 65535.

The daemon's workers listen next to it (:func:`worker_endpoint`): on tcp, the
daemon's port + 1 + device id; on ipc, ``NAME-worker-D.sock`` beside ``NAME.sock``.
:func:`daemon_endpoint_guess` inverts that rule for a client pointed at a worker.
"""

from __future__ import annotations

from graphlane.protocol.errors import BadRequest

__all__ = [
    "EXPECTED",
    "InvalidEndpoint",
    "check_endpoint",
    "daemon_endpoint_guess",
    "tcp_port",
    "worker_endpoint",
]

EXPECTED = "tcp://HOST:PORT or ipc://PATH"


class InvalidEndpoint(BadRequest, ValueError):
    """An endpoint that is not of a form ZeroMQ takes (a ValueError too)."""


def check_endpoint(endpoint: object, *, bind: bool = False, what: str = "endpoint") -> str:
    """``endpoint`` unchanged if it is well formed, else :class:`InvalidEndpoint`
    whose message says what is wrong and shows the expected forms."""
    if not isinstance(endpoint, str):
        raise InvalidEndpoint(
            f"{what} must be a string like {EXPECTED}, got {type(endpoint).__name__}"
        )
    problem = _problem(endpoint, bind)
    if problem is not None:
        raise InvalidEndpoint(f"{what} {endpoint!r}: {problem}; expected {EXPECTED}")
    return endpoint


def _problem(endpoint: str, bind: bool) -> str | None:
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return "no scheme" + (f" (did you mean tcp://{endpoint}?)" if ":" in endpoint else "")
    if scheme in ("ipc", "inproc"):
        return None if rest else "no path"
    if scheme != "tcp":
        return f"unsupported transport {scheme!r}"
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        return "no port"
    if host.startswith("[") != host.endswith("]"):
        return "unbalanced brackets around the host"
    if bind and port in ("*", "0"):
        return None  # any free port
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"port {port!r} is not a number from 1 to 65535" + (" (or 0: any)" if bind else "")
    if host == "*" and not bind:
        return "'*' is for binding; connect to a host"
    return None


def tcp_port(endpoint: str) -> int | None:
    """The port of a checked tcp endpoint; None for ipc/inproc and for any port (0, *)."""
    if not endpoint.startswith("tcp://"):
        return None
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() and int(port) > 0 else None


def worker_endpoint(listen: str, device: int) -> str:
    """Where the worker of ``device`` binds, given the daemon's ``listen`` endpoint."""
    if listen.startswith("ipc://"):
        base = listen[len("ipc://") :]
        stem = base[:-5] if base.endswith(".sock") else base
        return f"ipc://{stem}-worker-{device}.sock"
    host, _, port = listen[len("tcp://") :].rpartition(":")
    if port in ("0", "*"):
        return f"tcp://{host}:0"
    return f"tcp://{host}:{int(port) + 1 + device}"


def daemon_endpoint_guess(worker: str, device: int) -> str | None:
    """The daemon's endpoint by :func:`worker_endpoint`'s rule, for a client given the
    endpoint of ``device``'s worker (None when the rule does not say: a worker
    reached through another host name or a port the daemon did not choose)."""
    if worker.startswith("ipc://") and worker.endswith(f"-worker-{device}.sock"):
        return worker[: -len(f"-worker-{device}.sock")] + ".sock"
    port = tcp_port(worker)
    if port is not None and port - 1 - device > 0:
        return f"{worker.rpartition(':')[0]}:{port - 1 - device}"
    return None
