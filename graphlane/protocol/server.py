"""The server side of the wire: one received message's way to its replies.

Every server socket (the daemon's, each worker's) hands each message it receives to
a :class:`Responder`, which decodes it with its :class:`~.wire.Codec` (one request,
or a bundle's), gives each request to the process's :class:`Handler`, encodes what the
handler answers, or the error it raised, and sends the reply. So decoding, the
answer and the error map (a :class:`~.errors.GraphlaneError` is answered with its
code, any other exception is a bug: logged, answered INTERNAL; a request that does not
decode is answered with its DecodeError, or dropped and counted when it names no id)
are written once, here; the socket loops around it differ only in how they wait (the
daemon's asyncio task, a worker's poll over its socket and wake-up pipe).

A handler may answer later (a worker's step, answered when the device is done): it
returns :data:`LATER` and answers through :meth:`Responder.reply` or
:meth:`Responder.fail`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from graphlane.logs import Throttled
from graphlane.protocol.admission import DecodeError
from graphlane.protocol.errors import (
    BadRequest,
    Busy,
    GraphlaneError,
    InternalError,
    as_error,
)
from graphlane.protocol.wire import Codec, Request

_TRACEBACKS = 10
"""Failed requests logged with their tracebacks; after them, one line per 5 s."""

LATER: Any = object()
"""What a handler returns for a request it answers later (Responder.reply / fail)."""

Send = Callable[[Any, list[Any], bool], None]
"""How a server sends one reply: (routing id, frames, bundled: the request came in a
bundle, so its reply may wait to go back in one)."""


class Origin:
    """Where the requests of one message came from: the sender's routing id, whether
    they came bundled, when the message was received (perf_counter), with CURVE roles
    the sender's key (ZAP User-Id) and, when the server asked for it, ``source``: the
    routing id's Frame (which connection it came in on)."""

    __slots__ = ("bundled", "ident", "received", "sender", "source")

    def __init__(
        self, ident: Any, bundled: bool, received: float, sender: str | None, source: Any = None
    ) -> None:
        self.ident = ident
        self.bundled = bundled
        self.received = received
        self.sender = sender
        self.source = source


class Handler(Protocol):
    """What a server process does with its requests."""

    def answer(self, req: Request, origin: Origin) -> Any:
        """The reply body to ``req``, or LATER; raises the error to answer."""

    def refused(self, error: DecodeError, origin: Origin) -> None:
        """A request of this message did not decode and is answered ``error`` (its
        ``op`` set when only its body was wrong)."""


class Responder:
    """Decodes, answers and sends, for one server socket (see the module docstring).
    ``bundles``: whether this socket takes bundles (the daemon's refuses each request
    of one); ``between``: called between the requests of a bundle (a worker sends the
    replies of steps finished meanwhile); ``over_bound``: why a reply carrying data may
    not go to a peer (it has left too much unread), or None: such a reply is replaced
    by a BUSY error (not retryable: the request was done)."""

    def __init__(
        self,
        codec: Codec,
        handler: Handler,
        send: Send,
        log: logging.Logger,
        *,
        bundles: bool = True,
        between: Callable[[], None] | None = None,
        errors_by_code: Counter[str] | None = None,
        over_bound: Callable[[Any], str | None] | None = None,
    ) -> None:
        self.codec = codec
        self.handler = handler
        self.send = send
        self.log = log
        self.bundles = bundles
        self.between = between
        self.over_bound = over_bound
        self.counters = {"requests": 0, "replies": 0, "errors": 0, "undecodable": 0, "bundles": 0}
        #: wire code -> error replies sent (a worker's metrics render it)
        self.errors_by_code: Counter[str] = Counter() if errors_by_code is None else errors_by_code
        self._dropped_log = Throttled(log)
        # A request the server failed on (a bug): the first ones with their tracebacks,
        # then a line per interval with the count, whatever a peer sends.
        self._failed_log = Throttled(log, tracebacks=_TRACEBACKS)

    def message(self, frames: list[Any], sender: str | None = None, source: Any = None) -> None:
        """Answer one received message: ``frames[0]`` the sender's routing id, then the
        message (``sender``, ``source``: see Origin). Never raises for what it holds."""
        received = time.perf_counter()
        ident = frames[0]
        try:
            reqs: list[Request | DecodeError] = self.codec.decode_requests(frames[1:])
        except DecodeError as exc:
            # Without its traceback: that holds this frame, whose locals hold the error (a
            # cycle only the garbage collector ends), and the message's frames with it.
            reqs = [exc.with_traceback(None)]
        if len(reqs) == 1:
            self.request(reqs[0], Origin(ident, False, received, sender, source))
            return
        self.counters["bundles"] += 1
        origin = Origin(ident, True, received, sender, source)
        between = self.between
        for req in reqs:
            self.request(req, origin)
            if between is not None:
                between()

    def request(self, req: Request | DecodeError, origin: Origin) -> None:
        """Answer one decoded request (or its DecodeError)."""
        self.counters["requests"] += 1
        if type(req) is DecodeError:
            if req.request_id is None:
                self.counters["undecodable"] += 1
                self._dropped_log.warning("dropped an undecodable message: %s", req.message)
                return
            self.handler.refused(req, origin)
            self.fail(origin.ident, req.request_id, req.to_error(), origin.bundled)
            return
        assert type(req) is Request
        try:
            if origin.bundled and not self.bundles:
                raise BadRequest("the daemon's socket takes no bundles (a worker's does)")
            body = self.handler.answer(req, origin)
        except Exception as exc:  # never let one request take the server down
            if not isinstance(exc, GraphlaneError):
                self._failed_log.error("request %s (%s) failed", req.id, req.op, exc_info=exc)
            self.fail(origin.ident, req.id, as_error(exc), origin.bundled)
            return
        if body is not LATER:
            self.reply(origin.ident, req.id, body, origin.bundled)

    def reply(self, ident: Any, request_id: int, body: Any, bundled: bool) -> None:
        """Send an ok reply; a body that cannot be encoded is answered INTERNAL."""
        try:
            frames = self.codec.encode_reply(request_id, body)
        except ValueError as exc:  # e.g. a program's outputs that cannot be sent: say so
            self._failed_log.error(
                "reply to request %s cannot be encoded", request_id, exc_info=exc
            )
            self.fail(ident, request_id, InternalError(str(exc)), bundled)
            return
        if len(frames) > 1 and self.over_bound is not None:
            why = self.over_bound(ident)
            if why is not None:
                dropped = Busy(f"reply dropped: {why}", retryable=False)
                self.fail(ident, request_id, dropped, bundled)
                return
        self.counters["replies"] += 1
        self.send(ident, frames, bundled)

    def fail(self, ident: Any, request_id: int, error: GraphlaneError, bundled: bool) -> None:
        """Send an error reply."""
        self.counters["errors"] += 1
        self.errors_by_code[str(error.code)] += 1
        self.send(ident, self.codec.encode_error(request_id, error), bundled)


__all__ = ["LATER", "Handler", "Origin", "Responder", "Send"]
