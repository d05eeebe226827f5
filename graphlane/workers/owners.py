"""The clients that hold sequences on a worker, and their release when they go.

A sequence belongs to the client that added it (``Job.owner``, docs/models.md, "Whose
sequence"): its CURVE key where there is one, else its connection (the routing id).
:class:`SequenceOwners` keeps, for each such client, the connections it sent sequence
requests on, watched through :class:`~.connections.Connections`. When the last of them
closes, the client's sequences are released (the programs forget their records, blocks
and last tokens):

- a connection without a key is the client: nothing can name its sequences once it is
  gone (a reconnect is a new routing id, a new client), so they go at once;
- a key's go ``grace_s`` after its last connection closed, unless a connection of the
  same key sends a sequence request before then (a scheduler that reconnects keeps them).

So what the worker keeps is bounded by the clients with an open connection, plus the
keys within their grace (the admitted keys at most), each bounded by the programs' caps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from graphlane.workers.connections import Connections


class SequenceOwners:
    """Who holds sequences, through which connections; ``release(owner)`` called for each
    client whose last connection went (at once, or ``grace_s`` later for a key)."""

    def __init__(
        self, connections: Connections | None, grace_s: float, release: Callable[[Any], None]
    ) -> None:
        self.connections = connections
        self.grace_s = grace_s
        self._release = release
        self._idents: dict[bytes, Any] = {}  # a watched connection -> its client
        self._open: dict[Any, set[bytes]] = {}  # a client -> its watched connections
        #: clients with no connection left: owner -> when its sequences go (perf_counter)
        self.pending: dict[Any, float] = {}

    def note(self, owner: Any, ident: bytes, source: Any) -> bool:
        """``owner`` sends a sequence request on connection ``ident`` (``source``: the
        routing-id Frame of that message). False: that connection is closed already (its
        request must not leave anything behind); True: the connection is watched."""
        if ident in self._idents:
            return True
        if self.connections is not None and not self.connections.watch(ident, source):
            return False
        self._idents[ident] = owner
        self._open.setdefault(owner, set()).add(ident)
        self.pending.pop(owner, None)  # a key back within its grace keeps its sequences
        return True

    def gone(self, ident: bytes) -> None:
        """Connection ``ident`` closed (Connections' callback, through the worker)."""
        owner = self._idents.pop(ident, None)
        if owner is None:
            return
        idents = self._open[owner]
        idents.discard(ident)
        if idents:
            return
        del self._open[owner]
        if owner == ident:  # no key: the connection was the client
            self._release(owner)
        else:
            self.pending[owner] = time.perf_counter() + self.grace_s

    def release_due(self) -> None:
        """Release the clients whose grace has passed (the worker's loop, once a turn)."""
        if not self.pending:
            return
        now = time.perf_counter()
        for owner, due in list(self.pending.items()):
            if due <= now:
                del self.pending[owner]
                self._release(owner)


__all__ = ["SequenceOwners"]
