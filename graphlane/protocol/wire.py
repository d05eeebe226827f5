"""Frames and envelopes: the typed wire (the layout is in the package docstring).

Every envelope and every body is a :class:`msgspec.Struct`: decoding is typed
validation in one pass of C (an unknown field, a wrong type, a value out of its
bounds fails naming the field), and encoding packs the same Structs the
decoder reads, so sender and receiver share one definition of each message.

Before any byte is decoded, the message's frame count and sizes are checked
against :class:`Limits`, and what is read untyped is walked for its depth and
entries (:mod:`graphlane.protocol.admission`). An envelope is read in two steps:
the envelope itself (``v``, ``id``, ``op``, the body kept as raw bytes), then the
body with the type of its op; so every body error can be answered with the
request's id.
When the envelope itself cannot be read, a lenient second look finds the id
if it can (then the sender gets its BAD_REQUEST), else the message is dropped.

Tensors are ``{"$tensor": {"dtype", "shape", "frame" | "data"}}``, a frame of
their own or inline bytes for small ones (:mod:`graphlane.protocol.tensors`); the
bounds every body uses are in :mod:`graphlane.protocol.bounds`.
"""

from __future__ import annotations

import reprlib
import threading
from collections.abc import Sequence
from typing import Any, TypeAlias, TypeVar

import msgspec
import numpy as np
import torch
import zmq
from msgspec import Raw, Struct

from graphlane.protocol import admission
from graphlane.protocol.admission import DEFAULT_LIMITS, DecodeError, Limits
from graphlane.protocol.admission import is_bundle as _bundle
from graphlane.protocol.bounds import Name, RequestId
from graphlane.protocol.errors import ErrorCode, GraphlaneError, error_from_wire
from graphlane.protocol.ops.steps import StepDone
from graphlane.protocol.tensors import TENSOR_FIELDS, Frames, tensor_ref, with_tensors

PROTOCOL_VERSION = 1
T = TypeVar("T")
FrameLike: TypeAlias = bytes | bytearray | memoryview | zmq.Frame
Frame: TypeAlias = bytes | memoryview


# ------------------------------------------------------------------ encoding
# Bodies hold torch tensors; the hook below makes them ``$tensor`` references, with
# the frames of the message being encoded.
_local = threading.local()


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return tensor_ref(obj, _local.out, path="tensor")
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise NotImplementedError(f"{type(obj).__name__} cannot be sent")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encoder() -> msgspec.msgpack.Encoder:
    return _encoder


# ------------------------------------------------------------------ envelopes
class WireError(Struct, frozen=True, forbid_unknown_fields=True):
    code: str
    message: str
    retryable: bool


class _RequestEnvelope(Struct, frozen=True, forbid_unknown_fields=True):
    v: int
    id: RequestId
    op: Name
    body: Raw = Raw(b"\x80")  # an empty map


class _ReplyEnvelope(Struct, frozen=True, forbid_unknown_fields=True):
    v: int
    id: RequestId
    ok: bool
    body: Raw = Raw(b"\x80")  # an error reply has none: an empty map
    error: WireError | None = None


class _AnyId(Struct):
    """What a lenient second look reads of an envelope that failed its checks."""

    id: RequestId
    v: Any = msgspec.UNSET


_request_envelope = msgspec.msgpack.Decoder(_RequestEnvelope)
_reply_envelope = msgspec.msgpack.Decoder(_ReplyEnvelope)
_any_id = msgspec.msgpack.Decoder(_AnyId)
_reply_bundle = msgspec.msgpack.Decoder(list[_ReplyEnvelope])


class Request(Struct, frozen=True):
    """A decoded request envelope whose body is still bytes (see :meth:`body`), or
    decoded already (``decoded``, by :mod:`graphlane.protocol.requests`)."""

    id: int
    op: str
    raw: Raw
    frames: Frames
    decoded: Any = None

    def body(self, decoder: msgspec.msgpack.Decoder[T]) -> T:
        """The body, typed; :class:`DecodeError` (with this id) if it does not fit."""
        if self.decoded is not None:
            return self.decoded
        return decode_body(decoder, self.raw, self.frames, self.id)


class Reply(Struct, frozen=True):
    """A decoded reply: ``error`` set, or the body's bytes (see :meth:`body`)."""

    id: int
    raw: Raw
    error: GraphlaneError | None
    frames: Frames

    def body(self, decoder: msgspec.msgpack.Decoder[T]) -> T:
        if self.error is not None:
            raise self.error
        return decode_body(decoder, self.raw, self.frames, self.id)


def decode_body(
    decoder: msgspec.msgpack.Decoder[T], raw: Raw, frames: Frames, request_id: int | None
) -> T:
    kind: Any = decoder.type
    if admission.untyped(kind):  # reads values of any shape: walked first
        problem = admission.walk(memoryview(raw), 0, frames.limits)[1]
        if problem is not None:
            raise DecodeError(f"body: {problem}", request_id=request_id)
    try:
        body = decoder.decode(raw)
        fields = TENSOR_FIELDS.get(type(body))
        if fields is not None:
            body = with_tensors(body, fields, frames)
        frames.check_all_used()
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise DecodeError(_body_message(exc), request_id=request_id) from None
    except RecursionError:  # a typed decode skipping an unknown field nested too deep
        raise DecodeError(
            f"body: nested deeper than {frames.limits.max_depth} levels", request_id=request_id
        ) from None
    return body


def _location(exc: Exception) -> tuple[str, str]:
    """Where a msgspec error is, below ``$``, and what it is: "Expected `int` >= 0 -
    at `$.device`" -> (".device", "expected `int` >= 0"); a map's key: "... - at
    `key` in `$.params`" -> (".params (a key)", ...)."""
    text = str(exc)
    what, sep, where = text.rpartition(" - at `")
    if not sep:
        what, where = text, "$`"
    _, in_key, where = where.rstrip("`").rpartition("` in `")
    where = where.removeprefix("$") + (" (a key)" if in_key else "")
    # "Object missing required field `op`" -> (".op", "required field missing")
    for prefix, problem in _FIELD_PROBLEMS:
        if what.startswith(prefix) and what.endswith("`"):
            return f"{where}.{what[len(prefix) : -1]}", problem
    return where, what[:1].lower() + what[1:]


_FIELD_PROBLEMS = (
    ("Object missing required field `", "required field missing"),
    ("Object contains unknown field `", "unknown field"),
)


def _body_message(exc: Exception) -> str:
    # "Expected `int` >= 0 - at `$.device`" -> "body.device: expected `int` >= 0"; a
    # tensor's own error (".inputs[...].$tensor: ...", from _with_tensors) continues the path.
    where, what = _location(exc)
    return f"body{where}{what}" if what.startswith(".") else f"body{where}: {what}"


def encode_request(request_id: int, op: str, body: Any) -> list[Frame]:
    """The frames of a request (``body`` a Struct of ``op``). Raises ``ValueError``
    for a value that cannot be sent."""
    if type(request_id) is not int or not 0 <= request_id < 2**64:
        raise ValueError(f"request id must be an int in 0..2**64-1, got {request_id!r}")
    return _encode({"v": PROTOCOL_VERSION, "id": request_id, "op": op, "body": body})


def encode_reply(request_id: int, body: Any) -> list[Frame]:
    return _encode(_OkReply(PROTOCOL_VERSION, request_id, True, body))


def encode_done(
    request_id: int,
    outputs: dict[str, torch.Tensor],
    bucket: int,
    instance: int,
    patched: int,
    server_us: float,
    generation: int,
) -> list[Frame]:
    """``encode_reply(request_id, StepDone(outputs, ...))``, byte for byte, the outputs
    made references here, not by the encoder's hook; ValueError if one cannot be sent."""
    frames: list[Frame] = []
    refs = {name: tensor_ref(t, frames) for name, t in outputs.items()}
    done = StepDone(refs, bucket, instance, patched, server_us, generation)  # type: ignore[arg-type]
    try:
        head = _encoder.encode(_OkReply(PROTOCOL_VERSION, request_id, True, done))
    except (TypeError, OverflowError, NotImplementedError, RecursionError) as exc:
        raise ValueError(f"cannot encode: {exc}") from None
    return [head, *frames] if frames else [head]


def encode_error(request_id: int, error: GraphlaneError) -> list[Frame]:
    """The single frame of an error reply."""
    wire = WireError(str(error.code), error.message, error.retryable)
    return _encode({"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "error": wire})


class _OkReply(Struct, frozen=True):
    """An ok reply's envelope: packs as the map ``{"v", "id", "ok", "body"}`` would."""

    v: int
    id: int
    ok: bool
    body: Any


def _encode(envelope: Any) -> list[Frame]:
    frames: list[Frame] = []
    _local.out = frames
    try:
        head = _encoder.encode(envelope)
    except (TypeError, OverflowError, NotImplementedError, RecursionError) as exc:
        raise ValueError(f"cannot encode: {exc}") from None
    finally:
        _local.out = None
    return [head, *frames] if frames else [head]


# ------------------------------------------------------------------ messages
def decode_requests(
    frames: Sequence[FrameLike], limits: Limits = DEFAULT_LIMITS
) -> list[Request | DecodeError]:
    """The requests of a message, one or a bundle's: each a :class:`Request` or a
    :class:`DecodeError` in its place. Raises DecodeError when the message as a whole
    cannot be read (with the id frame 0 names, when it names one), never anything else."""
    try:
        return [
            _request(raw, data) if type(raw) is not DecodeError else raw
            for raw, data in _envelopes(admission.check_sizes(frames, limits), limits)
        ]
    except DecodeError:
        raise
    except Exception as exc:
        raise admission.unreadable(frames, exc) from None


def decode_replies(
    frames: Sequence[FrameLike], limits: Limits = DEFAULT_LIMITS
) -> list[Reply | DecodeError]:
    """The replies of a message, as :func:`decode_requests` reads requests."""
    try:
        # The common reply, one envelope as bytes within its limit, at once.
        head = frames[0] if len(frames) == 1 else None
        if type(head) is bytes and 0 < len(head) <= limits.max_envelope_bytes:
            buffers: list[Any] = [head]
        else:
            buffers = admission.check_sizes(frames, limits)
        typed = _typed_replies(buffers[0], buffers[1:], limits)
        if typed is not None:
            return typed
        return [
            _reply(raw, data) if type(raw) is not DecodeError else raw
            for raw, data in _envelopes(buffers, limits)
        ]
    except DecodeError:
        raise
    except Exception as exc:
        raise admission.unreadable(frames, exc) from None


def _typed_replies(head: Any, data: Sequence[memoryview], limits: Limits) -> list[Any] | None:
    """The replies of a message whose envelopes (one, or a bundle's) all read with their
    type at once, which bounds what is read but the bodies, skipped as bytes (a skip
    too deep is a RecursionError, not a crash: msgspec's skip costs little stack).
    None when the message must be read the careful way (walked first)."""
    try:
        if not _bundle(head):
            return [_reply_of(_reply_envelope.decode(head), Frames(data, limits))]
        if data:
            return None
        envs = _reply_bundle.decode(head)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    if not 0 < len(envs) <= limits.max_items:
        return None
    none = Frames((), limits)
    return [_reply_of(env, none) for env in envs]


def _envelopes(buffers: list[memoryview], limits: Limits) -> list[tuple[Any, Frames]]:
    """The envelopes of a message whose sizes are checked: each one's bytes with the
    message's data frames, or a DecodeError in its place when it breaks a limit of its
    shape (depth, entries; answered with its id if it names one): only what passed
    the walk (:mod:`.admission`) is handed to an untyped decode."""
    head = buffers[0]
    if not _bundle(head):
        problem = admission.walk(head, 0, limits)[1]
        envelope = head if problem is None else admission.refused(head, problem)
        return [(envelope, Frames(buffers[1:], limits))]
    if len(buffers) > 1:
        raise DecodeError("a bundle carries no data frames")
    try:
        items = admission.bundle_items(head, limits)
    except ValueError as exc:
        raise DecodeError(str(exc)) from None
    # One empty Frames serves every item: with no frames it never changes.
    none = Frames((), limits)
    return [
        (raw if problem is None else admission.refused(raw, problem), none)
        for raw, problem in items
    ]


def _request(raw: Any, frames: Frames) -> Request | DecodeError:
    try:
        env = _request_envelope.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        request_id, version = _lenient(raw)
        if version is not msgspec.UNSET and not _spoken(version):
            # Another version's envelope need not fit this one's: its sender hears
            # UNSUPPORTED_VERSION, not what it lacks by this version's rules.
            return _unsupported(version, request_id)
        return DecodeError(_envelope_message(exc), request_id=request_id)
    if not _spoken(env.v):
        return _unsupported(env.v, env.id)
    return Request(env.id, env.op, env.body, frames)


def _spoken(version: Any) -> bool:
    return type(version) is int and version == PROTOCOL_VERSION


def _unsupported(version: Any, request_id: int | None) -> DecodeError:
    return DecodeError(
        f"protocol version {reprlib.repr(version)} is not spoken here "
        f"(this side speaks {PROTOCOL_VERSION})",
        code=ErrorCode.UNSUPPORTED_VERSION,
        request_id=request_id,
    )


def _reply(raw: Any, frames: Frames) -> Reply | DecodeError:
    try:
        env = _reply_envelope.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return DecodeError(_envelope_message(exc), request_id=_lenient(raw)[0])
    return _reply_of(env, frames)


def _reply_of(env: _ReplyEnvelope, frames: Frames) -> Reply | DecodeError:
    if env.v != PROTOCOL_VERSION or env.ok != (env.error is None):
        problem = "version" if env.v != PROTOCOL_VERSION else "ok and error disagree"
        return DecodeError(f"reply envelope: {problem}", request_id=env.id)
    error = None
    if env.error is not None:
        if frames.count:
            return DecodeError("an error reply carries no data frames", request_id=env.id)
        error = error_from_wire(msgspec.structs.asdict(env.error))
    return Reply(env.id, env.body, error, frames)


def _lenient(raw: Any) -> tuple[int | None, Any]:
    """The id and ``v`` of an envelope that failed its checks (and passed its walk), as
    far as they can still be read (``v`` UNSET when not): from the whole map, else as
    :func:`.admission.scan_id` finds them."""
    try:
        found = _any_id.decode(raw)
        return found.id, found.v
    except (msgspec.ValidationError, msgspec.DecodeError):
        return admission.scan_id(raw)


def _envelope_message(exc: Exception) -> str:
    return "envelope" + _body_message(exc).removeprefix("body")


# ------------------------------------------------------------------ sockets
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
NOBLOCK = int(zmq.NOBLOCK)
# A plain int: zmq's flags are enums, and an enum costs a call where it is combined.
POLLIN = int(zmq.POLLIN)


def send_message(sock: zmq.Socket[Any], frames: Sequence[Any], flags: int = 0) -> None:
    """``frames`` as one message, as ``send_multipart`` sends them, without its
    per-call Python (flag enums, checks); ``flags`` applies to every part, and once
    the first part is taken the others are too (zmq delivers a message whole)."""
    last = len(frames) - 1
    if last:
        more = flags | _SNDMORE
        for i in range(last):
            sock.send(frames[i], more, copy=False)
    sock.send(frames[last], flags, copy=False)


def recv_message(sock: zmq.Socket[Any], copied: int, flags: int = 0) -> list[Any]:
    """One message: its first ``copied`` frames (a routing id, the envelope: small,
    and a copy costs less than a zero-copy frame object) as bytes, each further one
    (tensor data) as a zero-copy :class:`zmq.Frame`. ``zmq.Again`` when ``flags`` has
    NOBLOCK and no message waits."""
    frames: list[Any] = [sock.recv(flags)]
    getsockopt = sock.getsockopt
    while getsockopt(_RCVMORE):
        frames.append(sock.recv() if len(frames) < copied else sock.recv(copy=False))
    return frames


# ------------------------------------------------------------------ bundles
BUNDLE_BYTES = 64 * 1024
"""The largest bundle graphlane's senders make, far below any reader's envelope limit."""


_BUNDLE_MAX = 2**16 - 1  # envelopes in one bundle
_BUNDLE_HEADER = 3  # bytes of the largest array header bundle() writes


def bundle(envelopes: Sequence[bytes]) -> bytes:
    """Frame 0 of a bundle: the msgpack array of one-frame envelopes packed already."""
    n = len(envelopes)
    if not 1 <= n <= _BUNDLE_MAX:
        raise ValueError(f"a bundle holds 1 to {_BUNDLE_MAX} envelopes, not {n}")
    header = bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
    return header + b"".join(envelopes)


def bundles(envelopes: Sequence[bytes], max_bytes: int = BUNDLE_BYTES) -> list[tuple[int, bytes]]:
    """Frame 0 of each message carrying ``envelopes`` in order, with how many each
    carries: bundles of at most ``max_bytes``; an envelope alone goes as itself."""
    out: list[tuple[int, bytes]] = []
    start, size = 0, _BUNDLE_HEADER
    for i, envelope in enumerate(envelopes):
        if i > start and (size + len(envelope) > max_bytes or i - start == _BUNDLE_MAX):
            out.append(_message_of(envelopes[start:i]))
            start, size = i, _BUNDLE_HEADER
        size += len(envelope)
    if start < len(envelopes):
        out.append(_message_of(envelopes[start:]))
    return out


def _message_of(envelopes: Sequence[bytes]) -> tuple[int, bytes]:
    return len(envelopes), envelopes[0] if len(envelopes) == 1 else bundle(envelopes)
