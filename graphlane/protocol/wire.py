"""The codec: the one object that turns messages into frames and frames into messages.

:class:`Codec` owns the wire format (the layout is in the package docstring): it
encodes requests, replies and error replies, every tensor it meets made a
``$tensor`` reference with its bytes in a frame of their own (or inline), in the
encoder's one pass (its hook, as vLLM's ``MsgpackEncoder`` does with its aux
buffers); and it decodes them, with what they carry: a request's envelope, its body
typed by its op and the body's tensors over the message's frames are read in one
pass of msgspec (a tagged union of one envelope type per op; each tensor reference
makes itself a tensor as it is read, :mod:`graphlane.protocol.tensors`).

What it takes is checked before and while it reads (:mod:`.admission`): frame count
and sizes before any byte is decoded (TOO_LARGE); then the typed decode, bounded by
the types (an unknown field, a wrong type, a value out of its bounds fails naming the
field). A request that does not decode is explained, in the order the package
docstring gives, by reading it step by step with the same types, what is read
untyped walked for its depth and entries first; so the sender hears what is wrong,
with its request's id when it can be read. A reply's envelope is read at once, its
body (typed by the op of the request it answers, known to the caller) by
:meth:`Reply.body`.

One codec per process role and limits: encoding keeps its state per thread, decoding
none, so one may serve several threads. The module's functions (``encode_request``,
``decode_replies``, ...) are those of :data:`CODEC`, with the default limits.
"""

from __future__ import annotations

import reprlib
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any, TypeAlias, Union

import msgspec
import numpy as np
import zmq
from msgspec import Raw, Struct

from graphlane.protocol import admission
from graphlane.protocol.admission import DEFAULT_LIMITS, DecodeError, Limits, is_bundle
from graphlane.protocol.bounds import Name, RequestId
from graphlane.protocol.errors import (
    ErrorCode,
    GraphlaneError,
    WireError,
    error_from_wire,
    error_to_wire,
)
from graphlane.protocol.ops import OPS, Op
from graphlane.protocol.ops.steps import DeviceResult, DeviceValues
from graphlane.protocol.tensors import TENSOR_KEY, Frame, Frames, encoded_ref, read

PROTOCOL_VERSION = 1
FrameLike: TypeAlias = bytes | bytearray | memoryview | zmq.Frame

BUNDLE_MAX = 32
"""The most requests (or replies) graphlane's senders put in one bundle: a full one
goes at once. A receiver takes bundles of up to ``Limits.max_bundle`` (256) envelopes
from any sender; the sender's bound is the batching that pays: the worker answers a
bundle's requests together, so the first waits for the last, and 32 keeps two bundles
of a 64-call window in flight (the most steps/s on the null device)."""
BUNDLE_BYTES = 64 * 1024
"""The largest bundle graphlane's senders make, far below any reader's envelope limit."""


# ------------------------------------------------------------------ envelopes
class _RequestEnvelope(Struct, frozen=True, forbid_unknown_fields=True):
    """A request's envelope with its body kept as bytes: how a request that does not
    decode is explained (see :meth:`Codec._refusal`)."""

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


class _OkReply(Struct, frozen=True):
    """An ok reply's envelope: packs as the map ``{"v", "id", "ok", "body"}`` would."""

    v: int
    id: int
    ok: bool
    body: Any


class _ErrorReply(Struct, frozen=True):
    v: int
    id: int
    ok: bool
    error: WireError


class _AnyId(Struct):
    """What a lenient look reads of an envelope that failed its checks."""

    id: RequestId
    v: Any = msgspec.UNSET


def _envelope_of(op: Op) -> type[Struct]:
    """The envelope of one op: ``{"v", "id", "op": <its name>, "body": <its body>}``;
    ``body`` may be left out when its type needs no field."""
    try:
        empty: Any = op.request()
    except TypeError:  # a body with required fields: no default
        body: tuple[Any, ...] = ("body", op.request)
    else:
        body = ("body", op.request, msgspec.field(default_factory=lambda: empty))
    return msgspec.defstruct(
        f"_{op.name.title().replace('_', '')}Envelope",
        [("v", int), ("id", RequestId), body],
        tag_field="op",
        tag=op.name,
        forbid_unknown_fields=True,
        frozen=True,
    )


_OP_OF_ENVELOPE: dict[type, str] = {_envelope_of(op): name for name, op in OPS.items()}
_ANY_REQUEST: Any = Union[tuple(_OP_OF_ENVELOPE)]  # noqa: UP007
_request = msgspec.msgpack.Decoder(_ANY_REQUEST)
# list[_ANY_REQUEST], built at run time
_request_bundle: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    types.GenericAlias(list, _ANY_REQUEST)
)
# Typed through and through, these read no deeper than their types (a request nests at
# most 6 levels), but for the values msgspec skips to find the tag when ``op`` comes
# late: a skip too deep is a RecursionError (msgspec's skip costs little stack), and the
# request is then explained the careful way, walked first.
_request_envelope = msgspec.msgpack.Decoder(_RequestEnvelope)
_reply_envelope = msgspec.msgpack.Decoder(_ReplyEnvelope)
_reply_bundle = msgspec.msgpack.Decoder(list[_ReplyEnvelope])
_any_id = msgspec.msgpack.Decoder(_AnyId)
_request_bodies = {name: msgspec.msgpack.Decoder(op.request) for name, op in OPS.items()}
#: op name -> its reply body's decoder, and whether the body is walked first (untyped)
_reply_bodies = {
    name: (msgspec.msgpack.Decoder(op.reply), admission.untyped(op.reply))
    for name, op in OPS.items()
}
#: op name -> its reply body's decoder for ``Reply.body``'s ``lists``, for the ops that
#: answer a DeviceResult (the others' are read as they always are)
_reply_values = {
    name: msgspec.msgpack.Decoder(DeviceValues)
    for name, op in OPS.items()
    if op.reply is DeviceResult
}
_DECODE_ERRORS = (msgspec.ValidationError, msgspec.DecodeError, RecursionError, ValueError)


class Request(Struct, frozen=True):
    """A decoded request: its id, its op and its body, typed (tensors included)."""

    id: int
    op: str
    body: Any


class Reply(Struct, frozen=True):
    """A decoded reply: ``error`` set, or the body's bytes (see :meth:`body`)."""

    id: int
    raw: Raw
    error: GraphlaneError | None
    frames: Frames

    def body(self, op: Op, lists: bool = False) -> Any:
        """The body, typed as ``op``'s reply (tensors over the reply's frames; with
        ``lists``, each tensor's values as lists instead: ``Frames.values``); raises the
        reply's error if it is one, :class:`DecodeError` (with this id) if the body does
        not fit."""
        if self.error is not None:
            raise self.error
        decoder, walked = _reply_bodies[op.name]
        if walked:  # reads values of any shape: walked first
            problem = admission.walk(memoryview(self.raw), 0, self.frames.limits)[1]
            if problem is not None:
                raise DecodeError(f"body: {problem}", request_id=self.id)
        if lists and (values := _reply_values.get(op.name)) is not None:
            return _decode_values(values, self.raw, self.frames, self.id)
        return _decode_body(decoder, self.raw, self.frames, self.id, lists)


def _decode_body(
    decoder: msgspec.msgpack.Decoder[Any],
    raw: Any,
    frames: Frames,
    request_id: int | None,
    lists: bool = False,
) -> Any:
    try:
        return read(decoder, raw, frames, lists)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError, RecursionError) as exc:
        raise _body_error(exc, frames, request_id) from None


def _body_error(exc: Exception, frames: Frames, request_id: int | None) -> DecodeError:
    """The DecodeError of a body that did not read (RecursionError: a typed decode
    skipping an unknown field nested too deep)."""
    if isinstance(exc, RecursionError):
        return DecodeError(
            f"body: nested deeper than {frames.limits.max_depth} levels", request_id=request_id
        )
    return DecodeError(_body_message(exc), request_id=request_id)


def _decode_values(
    decoder: msgspec.msgpack.Decoder[Any], raw: Any, frames: Frames, request_id: int | None
) -> Any:
    """A DeviceResult's body read with each output the list of its values: decoded as a
    :class:`DeviceValues` (its references read, none made), then each output's values
    read from its bytes (:meth:`Frames.values`, checked as a tensor is), every frame
    used by one; what is wrong is the DecodeError :func:`_decode_body` would raise."""
    try:
        body = decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        raise _body_error(exc, frames, request_id) from None
    outputs = body.outputs
    try:
        for name, ref in outputs.items():
            outputs[name] = frames.values(ref.spec)
    except ValueError as exc:  # (msgspec would name the output "[...]": this names it)
        where = f".outputs[{name!r}].{TENSOR_KEY}"
        raise DecodeError(f"body{where}: {exc}", request_id=request_id) from None
    try:
        frames.check_all_used()
    except ValueError as exc:
        raise DecodeError(f"body: {exc}", request_id=request_id) from None
    return body


# ------------------------------------------------------------------ the codec
_encoding = threading.local()  # the frames of the message being encoded, per thread


def _enc_hook(obj: Any) -> Any:
    torch = sys.modules.get("torch")  # (no tensor without it: the daemon never imports it)
    if torch is not None and isinstance(obj, torch.Tensor):
        return encoded_ref(obj, _encoding.frames)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise NotImplementedError(f"{type(obj).__name__} cannot be sent")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


class Codec:
    """Messages to frames and back (see the module docstring); ``limits``: what its
    decoders take."""

    __slots__ = ("_no_frames", "limits", "tensors")

    def __init__(self, limits: Limits = DEFAULT_LIMITS, tensors: bool = True) -> None:
        self.limits = limits
        # The data frames of a reply that has none, shared: nothing marks them used.
        self._no_frames = Frames((), limits)
        #: False: a request's tensors are checked against their frames, never made (the
        #: daemon, which imports no torch, refuses the ops that carry them)
        self.tensors = tensors

    # -------------------------------------------------------------- encoding
    def encode_request(self, request_id: int, op: str, body: Any) -> list[Frame]:
        """The frames of a request (``body`` a Struct of ``op``). Raises ``ValueError``
        for a value that cannot be sent."""
        if type(request_id) is not int or not 0 <= request_id < 2**64:
            raise ValueError(f"request id must be an int in 0..2**64-1, got {request_id!r}")
        return _encode({"v": PROTOCOL_VERSION, "id": request_id, "op": op, "body": body})

    def encode_reply(self, request_id: int, body: Any) -> list[Frame]:
        """The frames of an ok reply; ``ValueError`` for a value that cannot be sent."""
        return _encode(_OkReply(PROTOCOL_VERSION, request_id, True, body))

    def encode_error(self, request_id: int, error: GraphlaneError) -> list[Frame]:
        """The single frame of an error reply."""
        return _encode(_ErrorReply(PROTOCOL_VERSION, request_id, False, error_to_wire(error)))

    # -------------------------------------------------------------- requests
    def decode_requests(self, frames: Sequence[FrameLike]) -> list[Request | DecodeError]:
        """The requests of a message, one or a bundle's: each a :class:`Request` or a
        :class:`DecodeError` in its place. Raises DecodeError when the message as a
        whole cannot be read (with the id frame 0 names, when it names one), never
        anything else."""
        limits = self.limits
        try:
            buffers = admission.check_sizes(frames, limits)
            head = buffers[0]
            if not is_bundle(head):
                return [self._request(head, buffers[1:])]
            if len(buffers) > 1:
                raise DecodeError("a bundle carries no data frames")
            return self._bundle(head)
        except DecodeError:
            raise
        except Exception as exc:
            raise admission.unreadable(frames, exc) from None

    def _request(self, raw: Any, data: Sequence[memoryview]) -> Request | DecodeError:
        try:
            env = read(_request, raw, Frames(data, self.limits, self.tensors))
        except _DECODE_ERRORS as exc:
            return self._refusal(raw, data, exc)
        if env.v != PROTOCOL_VERSION:
            return _unsupported(env.v, env.id)
        return Request(env.id, _OP_OF_ENVELOPE[type(env)], env.body)

    def _bundle(self, head: memoryview) -> list[Request | DecodeError]:
        """A bundle's requests, all in one pass when every one decodes (the common
        case); else each envelope on its own, each refusal in its place."""
        limits = self.limits
        admission.bundle_size(head, limits)  # too many: refused before anything is decoded
        try:  # a bundle's tensors: inline only
            envs = read(_request_bundle, head, Frames((), limits, self.tensors))
        except _DECODE_ERRORS:
            envs = None
        if (
            envs is not None
            and 0 < len(envs) <= limits.max_items
            and all(env.v == PROTOCOL_VERSION for env in envs)
        ):
            return [Request(env.id, _OP_OF_ENVELOPE[type(env)], env.body) for env in envs]
        try:
            items = admission.bundle_items(head, limits)  # walked: bounded
        except ValueError as exc:
            raise DecodeError(str(exc)) from None
        return [
            self._request(raw, ()) if problem is None else admission.refused(raw, problem)
            for raw, problem in items
        ]

    def _refusal(self, raw: Any, data: Sequence[memoryview], exc: Exception) -> DecodeError:
        """Why a request does not decode, found by reading it step by step in the order
        the package docstring gives, each step with the same types as the one pass."""
        problem = admission.walk(raw, 0, self.limits)[1]  # what is read untyped: bounded
        if problem is not None:
            return admission.refused(raw, problem)
        try:
            env = _request_envelope.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as envelope_exc:
            request_id, version = _lenient(raw)
            if version is not msgspec.UNSET and not _spoken(version):
                # Another version's envelope need not fit this one's: its sender hears
                # UNSUPPORTED_VERSION, not what it lacks by this version's rules.
                return _unsupported(version, request_id)
            return DecodeError(_envelope_message(envelope_exc), request_id=request_id)
        if not _spoken(env.v):
            return _unsupported(env.v, env.id)
        decoder = _request_bodies.get(env.op)
        if decoder is None:
            return DecodeError(f"unknown op {env.op!r} (known: {sorted(OPS)})", request_id=env.id)
        try:
            _decode_body(decoder, env.body, Frames(data, self.limits, self.tensors), env.id)
        except DecodeError as body_exc:
            body_exc.op = env.op
            return body_exc
        # Each step reads it (a value msgspec skipped too deep, found by none of them).
        return DecodeError(_envelope_message(exc), request_id=env.id)

    # -------------------------------------------------------------- replies
    def decode_replies(self, frames: Sequence[FrameLike]) -> list[Reply | DecodeError]:
        """The replies of a message, as :meth:`decode_requests` reads requests (their
        bodies left as bytes for :meth:`Reply.body`: the caller knows their op)."""
        limits = self.limits
        try:
            # The common reply, one envelope as bytes within its limit, at once.
            head = frames[0] if len(frames) == 1 else None
            if type(head) is bytes and 0 < len(head) <= limits.max_envelope_bytes:
                buffers: list[Any] = [head]
            else:
                buffers = admission.check_sizes(frames, limits)
            typed = _typed_replies(buffers[0], buffers[1:], limits, self._no_frames)
            if typed is not None:
                return typed
            return [
                _reply(raw, data) if type(raw) is not DecodeError else raw
                for raw, data in _reply_envelopes(buffers, limits)
            ]
        except DecodeError:
            raise
        except Exception as exc:
            raise admission.unreadable(frames, exc) from None


CODEC = Codec()
"""A codec with the default limits (:data:`.admission.DEFAULT_LIMITS`)."""
encode_request = CODEC.encode_request
encode_reply = CODEC.encode_reply
encode_error = CODEC.encode_error
decode_requests = CODEC.decode_requests
decode_replies = CODEC.decode_replies


def _encode(envelope: Any) -> list[Frame]:
    frames: list[Frame] = []
    _encoding.frames = frames
    try:
        head = _encoder.encode(envelope)
    except (TypeError, OverflowError, NotImplementedError, RecursionError) as exc:
        raise ValueError(f"cannot encode: {exc}") from None
    finally:
        _encoding.frames = None
    return [head, *frames] if frames else [head]


def _spoken(version: Any) -> bool:
    return type(version) is int and version == PROTOCOL_VERSION


def _unsupported(version: Any, request_id: int | None) -> DecodeError:
    return DecodeError(
        f"protocol version {reprlib.repr(version)} is not spoken here "
        f"(this side speaks {PROTOCOL_VERSION})",
        code=ErrorCode.UNSUPPORTED_VERSION,
        request_id=request_id,
    )


def _lenient(raw: Any) -> tuple[int | None, Any]:
    """The id and ``v`` of an envelope that failed its checks (and passed its walk), as
    far as they can still be read (``v`` UNSET when not): from the whole map, else as
    :func:`.admission.scan_id` finds them."""
    try:
        found = _any_id.decode(raw)
        return found.id, found.v
    except (msgspec.ValidationError, msgspec.DecodeError):
        return admission.scan_id(raw)


def _typed_replies(
    head: Any, data: Sequence[memoryview], limits: Limits, none: Frames
) -> list[Any] | None:
    """The replies of a message whose envelopes (one, or a bundle's) all read with their
    type at once, which bounds what is read but the bodies, skipped as bytes (a skip
    too deep is a RecursionError, not a crash: msgspec's skip costs little stack).
    None when the message must be read the careful way (walked first). ``none``: the
    codec's data frames of a message that has none (shared: nothing marks them used)."""
    try:
        if not is_bundle(head):
            frames = Frames(data, limits) if data else none
            return [_reply_of(_reply_envelope.decode(head), frames)]
        if data:
            return None
        envs = _reply_bundle.decode(head)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    if not 0 < len(envs) <= limits.max_items:
        return None
    return [_reply_of(env, none) for env in envs]


def _reply_envelopes(buffers: list[memoryview], limits: Limits) -> list[tuple[Any, Frames]]:
    """The envelopes of a reply message whose sizes are checked: each one's bytes with
    the message's data frames, or a DecodeError in its place when it breaks a limit of
    its shape (depth, entries; with its id if it names one): only what passed the walk
    (:mod:`.admission`) is handed to an untyped decode."""
    head = buffers[0]
    if not is_bundle(head):
        problem = admission.walk(head, 0, limits)[1]
        envelope = head if problem is None else admission.refused(head, problem)
        return [(envelope, Frames(buffers[1:], limits))]
    if len(buffers) > 1:
        raise DecodeError("a bundle carries no data frames")
    try:
        items = admission.bundle_items(head, limits)
    except ValueError as exc:
        raise DecodeError(str(exc)) from None
    none = Frames((), limits)  # with no frames it never changes
    return [
        (raw if problem is None else admission.refused(raw, problem), none)
        for raw, problem in items
    ]


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
        error = error_from_wire(env.error)
    return Reply(env.id, env.body, error, frames)


# ------------------------------------------------------------------ error messages
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
    # tensor's own error (".$tensor: ...", from TensorRef) continues the path.
    where, what = _location(exc)
    return f"body{where}{what}" if what.startswith(".") else f"body{where}: {what}"


def _envelope_message(exc: Exception) -> str:
    return "envelope" + _body_message(exc).removeprefix("body")


# ------------------------------------------------------------------ sockets
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
NOBLOCK = int(zmq.NOBLOCK)
# A plain int: zmq's flags are enums, and an enum costs a call where it is combined.
POLLIN = int(zmq.POLLIN)
_send = zmq.backend.Socket.send  # the compiled method sugar's Socket.send ends in
_COPY_THRESHOLD = zmq.COPY_THRESHOLD  # pyzmq copies a frame under it, whatever copy says


def send_message(sock: zmq.Socket[Any], frames: Sequence[Any], flags: int = 0) -> None:
    """``frames`` as one message, as ``send_multipart`` sends them, without its
    per-call Python (flag enums, checks); ``flags`` applies to every part, and once
    the first part is taken the others are too (zmq delivers a message whole)."""
    if type(sock) is not zmq.Socket:  # a subclass may send its own way (zmq.asyncio's)
        last = len(frames) - 1
        for i in range(last):
            sock.send(frames[i], flags | _SNDMORE, copy=False)
        sock.send(frames[last], flags, copy=False)
        return
    # A plain socket: pyzmq's compiled send itself (its Python wrapper only looks for
    # draft options), copying small bytes at once (pyzmq copies a frame under its
    # copy_threshold anyway, after making a memoryview of it) and handing larger
    # frames and tensors' views over without a copy.
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        copy = type(frame) is bytes and len(frame) < _COPY_THRESHOLD
        _send(sock, frame, flags | _SNDMORE if i < last else flags, copy)


def recv_message(
    sock: zmq.Socket[Any], copied: int, flags: int = 0, keep: int = 1 << 62
) -> list[Any]:
    """One message: its first ``copied`` frames (a routing id, the envelope: small) as
    bytes, each further one (tensor data) as a zero-copy :class:`zmq.Frame`.
    ``zmq.Again`` when ``flags`` has NOBLOCK and no message waits.

    Each frame is received as a Frame, whose ``more`` says whether another follows: a
    ``getsockopt(RCVMORE)`` per frame costs more than the Frame and its bytes' copy
    (2.2 us against 1.4 for a message of two frames).

    At most ``keep`` frames are kept: a message of more is read to its end and its
    other frames dropped (:func:`discard_rest`), so a receiver whose limit is ``keep
    - 1`` frames sees a message over it, in time and memory bounded by ``keep``, not by
    what the peer sent."""
    return recv_rest(sock, sock.recv(flags, copy=False), copied, keep)


def recv_rest(
    sock: zmq.Socket[Any], frame: zmq.Frame, copied: int, keep: int = 1 << 62
) -> list[Any]:
    """:func:`recv_message` whose first frame was received (``frame``): the message."""
    frames: list[Any] = [frame.bytes if copied else frame]
    while frame.more:
        if len(frames) >= keep:
            discard_rest(sock)
            break
        frame = sock.recv(copy=False)
        frames.append(frame.bytes if len(frames) < copied else frame)
    return frames


def discard_rest(sock: zmq.Socket[Any]) -> int:
    """Read and drop the frames left of the message being received (its previous frame
    had RCVMORE); how many. A zero-copy receive reads ``more`` from the frame itself,
    the cheapest way pyzmq has (no copy, no getsockopt), and each frame's memory goes
    back as it is dropped."""
    n = 1
    frame = sock.recv(copy=False)
    while frame.more:
        frame = sock.recv(copy=False)
        n += 1
    return n


# ------------------------------------------------------------------ bundles
_BUNDLE_HEADER = 3  # bytes of the largest array header bundle() writes


def bundle(envelopes: Sequence[bytes]) -> bytes:
    """Frame 0 of a bundle: the msgpack array of one-frame envelopes packed already."""
    n = len(envelopes)
    if not 1 <= n <= BUNDLE_MAX:
        raise ValueError(f"a bundle holds 1 to {BUNDLE_MAX} envelopes, not {n}")
    header = bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
    return header + b"".join(envelopes)


def bundles(envelopes: Sequence[bytes], max_bytes: int = BUNDLE_BYTES) -> list[tuple[int, bytes]]:
    """Frame 0 of each message carrying ``envelopes`` in order, with how many each
    carries: bundles of at most ``max_bytes``; an envelope alone goes as itself."""
    out: list[tuple[int, bytes]] = []
    start, size = 0, _BUNDLE_HEADER
    for i, envelope in enumerate(envelopes):
        if i > start and (size + len(envelope) > max_bytes or i - start == BUNDLE_MAX):
            out.append(_message_of(envelopes[start:i]))
            start, size = i, _BUNDLE_HEADER
        size += len(envelope)
    if start < len(envelopes):
        out.append(_message_of(envelopes[start:]))
    return out


def _message_of(envelopes: Sequence[bytes]) -> tuple[int, bytes]:
    return len(envelopes), envelopes[0] if len(envelopes) == 1 else bundle(envelopes)
