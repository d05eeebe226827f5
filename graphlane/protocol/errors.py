"""Wire error codes and the exception tree that carries them.

Every failed request is answered with one stable code (an :class:`ErrorCode`);
the message text is for people and may change. Both sides use the same tree:
the server raises a subclass and sends it as a :class:`WireError`,
``{"code", "message", "retryable"}`` (:func:`error_to_wire`, which the codec's
``encode_error`` calls); the receiving codec reads that map, typed, and turns it back
into the same subclass with :func:`error_from_wire`. Those two functions and
:class:`WireError` are the only definition of the map.

The tree is split by what the caller should do about it::

    GraphlaneError
    ├── RequestError        the request was wrong: fix it, do not retry
    │   ├── BadRequest          malformed message, unknown field, wrong type, over a limit
    │   ├── TooLarge            the message is larger than the receiver takes (its bytes,
    │   │                       its envelope's bytes, its frame count): send less per message
    │   ├── UnknownProgram      no program of that name is loaded
    │   ├── UnknownDevice       no worker serves that device id
    │   ├── UnsupportedVersion  the envelope's "v" is not a version this server speaks
    │   ├── Unauthorized        the CURVE handshake was refused: the key is not admitted
    │   │                       (raised by the client: the server sends nothing)
    │   ├── Forbidden           the key is admitted, but its role does not allow this
    │   │                       operation (an admin's, or another program's: docs/security.md)
    │   ├── StateLost           the request names a worker generation that is gone: the
    │                           device state it depends on (a KV cache) was lost in a
    │                           restart; re-read the generation, write the state again
    │   └── NoPreviousToken     a row asks for the token its sequence sampled in its
    │                           previous step (decoding ahead) and the worker has none
    │                           it may feed; send that token itself
    └── ServiceError        the service could not serve it now: may retry
        ├── Busy                queue full; retry after a pause            (retryable)
        ├── WorkerLost          the worker died while holding the request  (retryable)
        ├── Timeout             no result before the deadline              (retryable)
        ├── ShuttingDown        the daemon is draining or stopping         (retryable)
        ├── PredecessorFailed   an earlier request of this connection that changes device
        │                       state was not applied, so this one was not run: resume,
        │                       send the failed one again, then this one   (retryable)
        └── InternalError       a bug or an unexpected fault on the server (not retryable)

``retryable`` defaults from :data:`RETRYABLE` and a server may override it per
error (e.g. a ``TIMEOUT`` of a step that may already have been applied).
Tests assert on ``code``, never on message text.
"""

from __future__ import annotations

import enum
from typing import ClassVar

from msgspec import Struct

__all__ = [
    "RETRYABLE",
    "BadRequest",
    "Busy",
    "ErrorCode",
    "Forbidden",
    "GraphlaneError",
    "InternalError",
    "NoPreviousToken",
    "PredecessorFailed",
    "RequestError",
    "ServiceError",
    "ShuttingDown",
    "StateLost",
    "Timeout",
    "TooLarge",
    "Unauthorized",
    "UnknownDevice",
    "UnknownProgram",
    "UnsupportedVersion",
    "WireError",
    "WorkerLost",
    "as_error",
    "error_class",
    "error_from_wire",
    "error_to_wire",
]


class ErrorCode(enum.StrEnum):
    """Stable error codes sent on the wire (the value is the wire string)."""

    BAD_REQUEST = "BAD_REQUEST"
    UNKNOWN_PROGRAM = "UNKNOWN_PROGRAM"
    UNKNOWN_DEVICE = "UNKNOWN_DEVICE"
    BUSY = "BUSY"
    WORKER_LOST = "WORKER_LOST"
    TIMEOUT = "TIMEOUT"
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
    UNAUTHORIZED = "UNAUTHORIZED"
    FORBIDDEN = "FORBIDDEN"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    INTERNAL = "INTERNAL"
    STATE_LOST = "STATE_LOST"
    PREDECESSOR_FAILED = "PREDECESSOR_FAILED"
    TOO_LARGE = "TOO_LARGE"
    NO_PREVIOUS_TOKEN = "NO_PREVIOUS_TOKEN"


RETRYABLE: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.BUSY,
        ErrorCode.WORKER_LOST,
        ErrorCode.TIMEOUT,
        ErrorCode.SHUTTING_DOWN,
        ErrorCode.PREDECESSOR_FAILED,
    }
)
"""Codes whose errors are retryable unless the sender says otherwise."""


class GraphlaneError(Exception):
    """Base of every error that travels on the wire.

    Subclasses set the class attribute ``code``; the base itself reports
    ``INTERNAL`` so that a bare ``GraphlaneError`` is never mistaken for a
    request error.
    """

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL
    message: str
    retryable: bool

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = self.code in RETRYABLE if retryable is None else retryable

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, retryable={self.retryable})"


class RequestError(GraphlaneError):
    """The request was wrong: fix it, do not retry."""

    code = ErrorCode.BAD_REQUEST


class BadRequest(RequestError):
    """Malformed message, unknown field, wrong type or a value over a limit."""

    code = ErrorCode.BAD_REQUEST


class TooLarge(RequestError):
    """The message is larger than the receiver takes (``admission.Limits``: its bytes, its
    envelope's bytes or its frame count). Not retryable as is: split the work (a prompt's
    KV in several kv_writes, smaller inputs)."""

    code = ErrorCode.TOO_LARGE


class UnknownProgram(RequestError):
    """No graph program of that name is loaded."""

    code = ErrorCode.UNKNOWN_PROGRAM


class UnknownDevice(RequestError):
    """No worker serves that device id."""

    code = ErrorCode.UNKNOWN_DEVICE


class UnsupportedVersion(RequestError):
    """The envelope's protocol version is not one this peer speaks."""

    code = ErrorCode.UNSUPPORTED_VERSION


class Unauthorized(RequestError):
    """The server refused the CURVE handshake: the client's key is not admitted (or it
    sent none). The server answers nothing; the client's transport raises this."""

    code = ErrorCode.UNAUTHORIZED


class Forbidden(RequestError):
    """The client's key is admitted, but the server's configuration does not let it make
    this request: an administrative operation (``drain``, ``shutdown``) from a key not in
    ``admin_keys``, or a request to a program whose ``clients`` do not name the key
    (docs/security.md). Not retryable: another key, or another configuration, is needed."""

    code = ErrorCode.FORBIDDEN


class StateLost(RequestError):
    """The request names a worker generation other than the worker's: the worker
    restarted since, and the device state the request depends on (a program's KV
    cache) is gone. Not retryable as is: the scheduler reads the new generation
    (hello), writes the state again (kv_write) and names the new generation."""

    code = ErrorCode.STATE_LOST


class NoPreviousToken(RequestError):
    """A step row asks for the token its sequence sampled in its previous step (decoding
    ahead: docs/models.md) and this worker has no such token it may feed: that step was
    refused, failed or never reached this worker (it was cancelled, or ran on a worker
    that has since restarted), it was not the step right before this one (the lengths
    do not follow), or the token was overwritten since. Feeding anything else would be
    a stale token, so the row is refused. Not retryable as is: send the token itself
    (or prefill the sequence again after STATE_LOST)."""

    code = ErrorCode.NO_PREVIOUS_TOKEN


class ServiceError(GraphlaneError):
    """The service could not serve the request now: it may be retried."""

    code = ErrorCode.INTERNAL


class Busy(ServiceError):
    """The target's queue is full."""

    code = ErrorCode.BUSY


class WorkerLost(ServiceError):
    """The worker process died or stopped answering while it held the request."""

    code = ErrorCode.WORKER_LOST


class Timeout(ServiceError):
    """No result before the request's deadline."""

    code = ErrorCode.TIMEOUT


class ShuttingDown(ServiceError):
    """The daemon is draining or stopping and takes no new work."""

    code = ErrorCode.SHUTTING_DOWN


class PredecessorFailed(ServiceError):
    """An earlier request of the same connection to this device that changes a program's
    device state (a ``kv_write`` or a ``step`` of a stateful program) was refused or
    failed, so it was not applied; this request depends on that state and was not run
    either (the message names the failed request). The connection's requests to stateful
    programs are refused so until it sends ``resume`` (graphlane's Client sends it on
    its own when it sees the failure); then send the failed request again (``kv_write``
    and ``step`` are idempotent), and this one."""

    code = ErrorCode.PREDECESSOR_FAILED


class InternalError(ServiceError):
    """A bug or an unexpected fault on the server (also: an unreadable error from the peer)."""

    code = ErrorCode.INTERNAL


def as_error(exc: BaseException) -> GraphlaneError:
    """What to answer for ``exc``: itself when it is a GraphlaneError, else an INTERNAL
    error naming it (a server's bug is reported, never raised at the caller)."""
    if isinstance(exc, GraphlaneError):
        return exc
    return InternalError(f"{type(exc).__name__}: {exc}")


_CLASSES: dict[ErrorCode, type[GraphlaneError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        TooLarge,
        UnknownProgram,
        UnknownDevice,
        UnsupportedVersion,
        Unauthorized,
        Forbidden,
        StateLost,
        NoPreviousToken,
        Busy,
        WorkerLost,
        Timeout,
        ShuttingDown,
        PredecessorFailed,
        InternalError,
    )
}
assert set(_CLASSES) == set(ErrorCode), "every code needs exactly one class"


def error_class(code: str | ErrorCode) -> type[GraphlaneError]:
    """The exception class of a wire code; an unknown code maps to :class:`InternalError`."""
    try:
        return _CLASSES[ErrorCode(code)]
    except ValueError:
        return InternalError


class WireError(Struct, frozen=True, forbid_unknown_fields=True):
    """The ``error`` map of an error reply (a field missing, unknown or of another type
    is refused when the reply is decoded, naming the field)."""

    code: str
    message: str
    retryable: bool


def error_to_wire(error: GraphlaneError) -> WireError:
    return WireError(str(error.code), error.message, error.retryable)


def error_from_wire(error: WireError) -> GraphlaneError:
    """The exception an error reply describes. A code this side does not know becomes
    an :class:`InternalError` whose message keeps the code and the peer's message (its
    ``retryable`` flag is kept)."""
    try:
        known = ErrorCode(error.code)
    except ValueError:
        return InternalError(
            f"unknown error code {error.code!r}: {error.message}", retryable=error.retryable
        )
    return _CLASSES[known](error.message, retryable=error.retryable)
