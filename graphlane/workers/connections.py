"""The connections of a worker's socket: which one a message came in on, and when it goes.

A ROUTER socket names each connection by a routing id, and libzmq tells its owner
nothing when one closes (``ZMQ_ROUTER_NOTIFY`` is a draft API, absent from the libzmq
pyzmq ships). Two things it does say: its socket monitor reports each connection
accepted and each one gone, by file descriptor, and every message received carries
the descriptor it came in on (``ZMQ_SRCFD``, a property of its routing-id frame).

A descriptor is reused once closed, so :class:`Connections` counts, per descriptor,
the connections accepted on it and those gone from it (the monitor reports them in
order: a descriptor's close comes before its reuse). A routing id watched while the
k-th connection on its descriptor is the open one is gone when the k-th close on that
descriptor is reported; a message whose descriptor has no open connection came from
one that is gone already. Per-connection state (the ordering fence of
docs/programs.md, "Ordering and retries") is freed through ``gone(routing id)``, so
it is bounded by the connections a worker has open, which the file-descriptor limit
bounds, and nothing of a live connection is ever forgotten to make room.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class Connections:
    """The connections of ``sock`` (a bound ROUTER), and ``gone(routing id)`` called for
    each watched one when it closes. Its :attr:`monitor` socket must be read whenever it
    is readable (:meth:`take_events`): the worker's loop polls it beside its socket."""

    def __init__(self, sock: zmq.Socket[Any], gone: Callable[[bytes], None]) -> None:
        self.sock = sock
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self._gone = gone
        self._accepted: dict[int, int] = {}  # descriptor -> connections accepted on it
        self._closed: dict[int, int] = {}  # descriptor -> connections gone from it
        # descriptor -> {routing id: which connection on it (1, 2, ...)}
        self._watched: dict[int, dict[bytes, int]] = {}

    def watch(self, ident: bytes, source: Any) -> bool:
        """Call ``gone(ident)`` when the connection that ``source`` (the routing-id frame
        of one of its messages) came in on closes. False: it is closed already (nothing
        to watch); True: watched, or its descriptor cannot be read (an inproc peer: it is
        never reported gone)."""
        self.take_events()  # its own accept is reported by now: it came before its message
        fd = source.get(zmq.SRCFD) if isinstance(source, zmq.Frame) else -1
        if fd < 0:
            return True
        nth = self._accepted.get(fd, 0)
        if self._closed.get(fd, 0) >= nth:
            return False
        self._watched.setdefault(fd, {})[ident] = nth
        return True

    def take_events(self) -> None:
        """Read what the monitor reported; call ``gone`` for each watched connection closed."""
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted[fd] = self._accepted.get(fd, 0) + 1
                continue
            closed = self._closed[fd] = self._closed.get(fd, 0) + 1
            watched = self._watched.get(fd)
            if not watched:
                continue
            for ident, nth in list(watched.items()):
                if nth <= closed:
                    del watched[ident]
                    self._gone(ident)
            if not watched:
                del self._watched[fd]

    @property
    def watched(self) -> int:
        """Connections watched now."""
        return sum(map(len, self._watched.values()))

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)


__all__ = ["Connections"]
