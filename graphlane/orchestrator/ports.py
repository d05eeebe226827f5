"""The daemon's tcp ports, checked before anything binds them.

The daemon listens on ``listen`` and each device's worker on the next ports:
``listen`` port + 1 + device id (e.g. 7450, then 7451 and 7452 for devices 0
and 1); with ``metrics_port``, its Prometheus endpoint listens there too. A port
that another process holds would otherwise fail deep inside ZeroMQ or
http.server (the daemon's as a traceback, a worker's as a restart loop);
:func:`check_ports` names it, and the setting that chose it, in one line first.
A port freed by then and taken again later still fails at bind:
:func:`bind_error` words that the same way.
"""

from __future__ import annotations

import contextlib
import errno
import socket

from .config import ServeConfig

__all__ = [
    "METRICS_ROLE",
    "PortInUse",
    "bind_error",
    "check_ports",
    "free_loopback_ports",
    "metrics_endpoint",
]


class PortInUse(RuntimeError):
    """A tcp port the daemon needs is taken; the message names it and its role."""


def _split(endpoint: str) -> tuple[str, int] | None:
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return None
    host = host.strip("[]")
    return ("" if host in ("*", "0.0.0.0") else host), int(port)


def _taken(host: str, port: int) -> OSError | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host or None, port, family, socket.SOCK_STREAM)
    except OSError:
        return None  # a name that does not resolve: let the bind say so
    for *_, address in infos[:1]:
        with contextlib.closing(socket.socket(family, socket.SOCK_STREAM)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
            try:
                s.bind(address)
            except OSError as exc:
                return exc
    return None


#: The setting that chose each kind of port, as the one-line errors name it.
LISTEN_SETTING = "--listen port (listen)"
METRICS_SETTING = "--metrics-port (metrics_port)"
METRICS_ROLE = "the metrics port (metrics_port)"


def metrics_endpoint(host: str, port: int) -> str:
    """The metrics server's address written as a tcp endpoint (for the messages)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _roles(config: ServeConfig) -> list[tuple[str, str]]:
    roles = [(config.listen, "the daemon's port (listen)")]
    base = _split(config.listen)
    span = f": {base[1] + 1}..{base[1] + 1 + max(config.devices)}" if base else ""
    for d in config.devices:
        role = f"device {d}'s worker (workers use the listen port + 1 + device id{span})"
        roles.append((config.worker_endpoint(d), role))
    if config.metrics_port:  # 0: any free port, nothing to check
        roles.append((metrics_endpoint(config.metrics_host, config.metrics_port), METRICS_ROLE))
    return roles


def check_ports(config: ServeConfig) -> None:
    """PortInUse naming the first tcp port of ``config`` that cannot be bound."""
    for endpoint, role in _roles(config):
        split = _split(endpoint)
        if split is None:
            continue
        exc = _taken(*split)
        if exc is not None:
            raise PortInUse(_message(endpoint, split[1], role, exc))


def _message(endpoint: str, port: int, role: str, exc: Exception) -> str:
    in_use = getattr(exc, "errno", None) == errno.EADDRINUSE
    why = "is in use (another graphlane daemon?)" if in_use else f"{exc}"
    setting = METRICS_SETTING if role == METRICS_ROLE else LISTEN_SETTING
    return (
        f"cannot listen on {endpoint}: port {port}, {role}, {why}; stop that process or "
        f"choose another {setting}"
    )


def bind_error(endpoint: str, role: str, exc: Exception) -> str:
    """The one-line message of a failed bind of ``endpoint``."""
    split = _split(endpoint)
    if split is not None and getattr(exc, "errno", None) is not None:  # OSError, ZMQError
        return _message(endpoint, split[1], role, exc)
    setting = METRICS_SETTING if role == METRICS_ROLE else "--listen (listen)"
    return f"cannot listen on {endpoint} ({role}): {exc}; check {setting}"


def free_loopback_ports(n: int) -> list[int]:
    """``n`` distinct tcp ports of 127.0.0.1 that nothing holds now, which the system
    chose: a tensor-parallel group's rendezvous and forwarding channel, taken afresh at
    each start of the group (a port the group before held may still be in TIME_WAIT).
    Another process may take one before the group binds it: the group's start fails
    then, and is retried as any failed start is."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
