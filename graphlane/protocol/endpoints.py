"""ZeroMQ endpoints, checked before any socket exists.

libzmq answers a malformed endpoint with ``EINVAL`` only after a socket was made
for it, and a socket left open by that failure keeps its context from ever
terminating. Every endpoint a user gives (``Client``, ``--connect``,
``--listen``, the config's ``listen``) goes through :func:`check_endpoint`
first, which names the expected forms::

    tcp://HOST:PORT      e.g. tcp://127.0.0.1:7450, tcp://[::1]:7450, tcp://node-3:7450
    ipc://PATH           e.g. ipc:///run/graphlane/daemon.sock
    inproc://NAME        same process only (tests)

A bind (``listen``) may also use ``*`` for HOST and ``*`` for PORT.
"""

from __future__ import annotations

from graphlane.protocol.errors import BadRequest

__all__ = ["EXPECTED", "InvalidEndpoint", "check_endpoint"]

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
    if bind and port == "*":
        return None
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"port {port!r} is not a number from 1 to 65535"
    if host == "*" and not bind:
        return "'*' is for binding; connect to a host"
    return None
