"""Encoding and decoding of multipart messages (the layout is in the package docstring).

Encoding turns a body that may hold ``torch.Tensor`` values into frames: the
msgpack envelope first, then one frame per tensor larger than
:data:`INLINE_TENSOR_BYTES`, each a ``memoryview`` over the tensor's own memory
(no copy unless the tensor is not contiguous). Encoding mistakes are the
caller's bugs and raise ``ValueError`` naming the path of the bad value.

A bundle (:func:`bundle`) is frame 0 holding an array of envelopes packed
already; :func:`decode_requests` and :func:`decode_replies` read one message of
either kind into a list, an envelope that fails its checks becoming a
:class:`DecodeError` in its place. :func:`decode_request` and
:func:`decode_reply` take single envelopes only.

Decoding is validation. Whatever bytes arrive, :func:`decode_request` and
:func:`decode_reply` either return a value whose every part has the documented
type and is within :class:`Limits`, or raise :class:`DecodeError`; nothing else
escapes. Tensors read from frames are views over the received buffers (no
copy): treat them as read-only and copy what must outlive the message.

The encoded frames share memory with the tensors they came from until zmq has
sent them (``send_multipart(frames, copy=False)`` sends later, from zmq's I/O
thread): do not write to those tensors before the send is done.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NoReturn, TypeAlias, TypeVar

import msgpack
import numpy as np
import torch
import zmq

from graphlane.protocol.errors import ErrorCode, GraphlaneError, error_class, error_from_wire

__all__ = [
    "BUNDLE_BYTES",
    "DEFAULT_LIMITS",
    "DTYPES",
    "INLINE_TENSOR_BYTES",
    "PROTOCOL_VERSION",
    "TENSOR_KEY",
    "DecodeError",
    "FrameLike",
    "Limits",
    "Reply",
    "Request",
    "bundle",
    "bundles",
    "decode_replies",
    "decode_reply",
    "decode_request",
    "decode_requests",
    "encode_error",
    "encode_outputs_reply",
    "encode_reply",
    "encode_request",
    "tensor_to_wire",
]

PROTOCOL_VERSION = 1
INLINE_TENSOR_BYTES = 1024
"""Tensors of at most this many bytes travel inside the envelope, larger ones as frames."""
TENSOR_KEY = "$tensor"
"""The one key of a map that stands for a tensor; reserved everywhere in a body."""

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

_UINT64_MAX = 2**64 - 1
_INT_MIN = -(2**63)
_MAX_ENCODE_DEPTH = 64  # only guards against cycles; the receiver's Limits.max_depth is smaller
_REQUEST_KEYS = frozenset({"v", "id", "op", "body"})
_REPLY_OK_KEYS = frozenset({"v", "id", "ok", "body"})
_REPLY_ERROR_KEYS = frozenset({"v", "id", "ok", "error"})
_TENSOR_FIELDS = frozenset({"dtype", "shape", "frame", "data"})
_PLAIN_TYPES = frozenset({type(None), bool, float, str, bytes})  # sent as they are
_SCALAR_TYPES = frozenset({type(None), bool, int, float, str, bytes})  # as msgpack returns them

FrameLike: TypeAlias = bytes | bytearray | memoryview | zmq.Frame


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts. Every limit is checked before the work it bounds."""

    max_message_bytes: int = 256 * 2**20  # sum of all frames
    max_frames: int = 64  # envelope included
    max_envelope_bytes: int = 1 * 2**20  # frame 0
    max_depth: int = 8  # nesting of maps/lists in the body; the body itself is level 1
    max_items: int = 4096  # length of any list or map
    max_str_bytes: int = 64 * 1024  # utf-8 length of any str
    max_tensor_bytes: int = 256 * 2**20
    max_tensor_dims: int = 8

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{f.name} must be an int >= 1, got {value!r}")


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Request:
    """A decoded request: the envelope's id and op, and the body with tensors decoded."""

    id: int
    op: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Reply:
    """A decoded reply: ``ok`` with a body, or not ``ok`` with an error (then ``body == {}``)."""

    id: int
    ok: bool
    body: dict[str, Any]
    error: GraphlaneError | None

    def unwrap(self) -> dict[str, Any]:
        """The body of an ok reply; raises the reply's error otherwise."""
        if self.error is not None:
            raise self.error
        return self.body


class DecodeError(Exception):
    """A message that cannot be accepted.

    ``request_id`` is set when the id could be read (then the sender gets a
    reply with ``code``: see :meth:`to_error`), None otherwise (then the message
    is only counted and logged). ``message`` names the offending field.
    """

    request_id: int | None
    code: ErrorCode
    message: str

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode = ErrorCode.BAD_REQUEST,
        request_id: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def to_error(self) -> GraphlaneError:
        """The wire error to send back to the peer."""
        return error_class(self.code)(self.message)


# ---------------------------------------------------------------------------- encoding


def encode_request(request_id: int, op: str, body: Mapping[str, Any]) -> list[bytes | memoryview]:
    """Frames of a request. Raises ``ValueError`` for a value that cannot be sent."""
    _check_id(request_id)
    if not isinstance(op, str) or not op:
        raise ValueError(f"op must be a non-empty str, got {op!r}")
    frames: list[bytes | memoryview] = []
    wire_body = _body_to_wire(body, frames)
    envelope = {"v": PROTOCOL_VERSION, "id": request_id, "op": op, "body": wire_body}
    return [_pack(envelope), *frames]


def encode_reply(request_id: int, body: Mapping[str, Any]) -> list[bytes | memoryview]:
    """Frames of an ok reply. Raises ``ValueError`` for a value that cannot be sent."""
    _check_id(request_id)
    frames: list[bytes | memoryview] = []
    return _ok_reply(request_id, _body_to_wire(body, frames), frames)


def encode_outputs_reply(
    request_id: int, outputs: Mapping[str, torch.Tensor], fields: Mapping[str, int | float]
) -> list[bytes | memoryview]:
    """Frames of an ok reply whose body is ``{"outputs": outputs, **fields}``: what
    :func:`encode_reply` makes of it, without its walk over arbitrary values (a
    worker's reply to every step). ``request_id`` is one a decoder read."""
    frames: list[bytes | memoryview] = []
    wire = {}
    for name, t in outputs.items():
        if type(t) is not torch.Tensor:
            raise ValueError(f"body.outputs.{name}: must be a tensor, got {type(t).__name__}")
        wire[name] = tensor_to_wire(t, frames, path="body.outputs")
    return _ok_reply(request_id, {"outputs": wire, **fields}, frames)


def _ok_reply(
    request_id: int, wire_body: dict[str, Any], frames: list[bytes | memoryview]
) -> list[bytes | memoryview]:
    envelope = {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "body": wire_body}
    return [_pack(envelope), *frames]


def encode_error(request_id: int, error: GraphlaneError) -> list[bytes]:
    """The single frame of an error reply."""
    _check_id(request_id)
    if not isinstance(error, GraphlaneError):
        raise ValueError(f"error must be a GraphlaneError, got {type(error).__name__}")
    envelope = {"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "error": error.to_wire()}
    return [_pack(envelope)]


def tensor_to_wire(
    t: torch.Tensor, frames: list[bytes | memoryview], *, path: str = "tensor"
) -> dict[str, Any]:
    """The ``$tensor`` map of a CPU tensor.

    A tensor of more than :data:`INLINE_TENSOR_BYTES` bytes is appended to
    ``frames`` (the data frames that follow the envelope, so the reference is
    ``len(frames)`` after the append) as a memoryview over its memory; a
    non-contiguous tensor is first copied into a contiguous one.
    """
    if not t.is_cpu:
        raise ValueError(f"{path}: tensor is on {t.device}; copy it to the CPU before sending")
    if t.layout != torch.strided:
        raise ValueError(f"{path}: {t.layout} tensors cannot be sent, only strided ones")
    dtype = t.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"{path}: dtype {dtype} cannot be sent (supported: {sorted(DTYPES)})")
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    spec: dict[str, Any] = {"dtype": name, "shape": list(t.shape)}
    if t.nbytes <= INLINE_TENSOR_BYTES:
        # numpy has no bfloat16: that one goes through a byte view.
        spec["data"] = (_byte_view(t) if dtype is torch.bfloat16 else t.numpy()).tobytes()
    else:
        frames.append(_byte_view(t))
        spec["frame"] = len(frames)
    return {TENSOR_KEY: spec}


def _byte_view(t: torch.Tensor) -> memoryview:
    """A flat byte memoryview over a contiguous CPU tensor's memory (shares it)."""
    # reshape(-1) first: a 0-dim tensor cannot be viewed as a dtype of another size.
    return t.reshape(-1).view(torch.uint8).numpy().data


def _check_id(request_id: int) -> None:
    if isinstance(request_id, bool) or not isinstance(request_id, int):
        raise ValueError(f"request id must be an int, got {type(request_id).__name__}")
    if not 0 <= request_id <= _UINT64_MAX:
        raise ValueError(f"request id must fit in uint64, got {request_id}")


def _pack(envelope: dict[str, Any]) -> bytes:
    # One Packer per thread, reused: packb makes a new one per call (a quarter of
    # the cost of packing an envelope). A Packer is not thread-safe, hence per thread;
    # it resets itself when a pack fails.
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    packed: bytes = packer.pack(envelope)
    return packed


_packers = threading.local()


def _body_to_wire(body: Mapping[str, Any], frames: list[bytes | memoryview]) -> dict[str, Any]:
    if type(body) is dict and _as_is(body, 1):
        return body  # msgpack packs it as it is: no copy
    if not isinstance(body, Mapping):
        raise ValueError(f"body must be a mapping, got {type(body).__name__}")
    wire = _to_wire(body, "body", frames, 1)
    assert isinstance(wire, dict)
    return wire


def _as_is(value: dict[Any, Any] | list[Any] | tuple[Any, ...], depth: int) -> bool:
    """Whether msgpack packs ``value`` exactly as :func:`_to_wire` would convert it:
    only exact dicts (str keys, not the tensor key), lists, tuples and scalars, ints
    in range, within the nesting bound. It allocates nothing; on False the walk in
    :func:`_to_wire` converts the value or names what cannot be sent."""
    if depth > _MAX_ENCODE_DEPTH:
        return False
    if type(value) is dict:
        if TENSOR_KEY in value:
            return False
        for key, item in value.items():
            if type(key) is not str:
                return False
            kind = type(item)
            if kind in _PLAIN_TYPES:
                continue
            if kind is int:
                if not _INT_MIN <= item <= _UINT64_MAX:
                    return False
                continue
            if (kind is list or kind is tuple) and depth < _MAX_ENCODE_DEPTH:
                for x in item:  # a flat list of scalars (lengths, names): checked in place
                    if type(x) not in _PLAIN_TYPES and not (
                        type(x) is int and _INT_MIN <= x <= _UINT64_MAX
                    ):
                        break
                else:
                    continue
            if not ((kind is dict or kind is list or kind is tuple) and _as_is(item, depth + 1)):
                return False
        return True
    for item in value:
        kind = type(item)
        if kind in _PLAIN_TYPES:
            continue
        if kind is int:
            if not _INT_MIN <= item <= _UINT64_MAX:
                return False
        elif not ((kind is dict or kind is list or kind is tuple) and _as_is(item, depth + 1)):
            return False
    return True


def _to_wire(value: Any, path: str, frames: list[bytes | memoryview], depth: int) -> Any:
    kind = type(value)
    if kind is torch.Tensor:  # the common cases first: exact types skip the ABC checks
        return tensor_to_wire(value, frames, path=path)
    if kind is not dict and (value is None or isinstance(value, bool | float | str | bytes)):
        return value
    if isinstance(value, int):
        if not _INT_MIN <= value <= _UINT64_MAX:
            raise ValueError(f"{path}: int {value} does not fit in 64 bits")
        return int(value)
    if isinstance(value, torch.Tensor):
        return tensor_to_wire(value, frames, path=path)
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if depth > _MAX_ENCODE_DEPTH:
        raise ValueError(f"{path}: nested deeper than {_MAX_ENCODE_DEPTH} levels (a cycle?)")
    # In containers, items msgpack takes as they are skip the call and the path string.
    if kind is dict or isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{path}: map keys must be str, got {type(key).__name__}")
            if key == TENSOR_KEY:
                raise ValueError(f"{path}: the key {TENSOR_KEY!r} is reserved for tensors")
            kind = type(item)
            if kind in _PLAIN_TYPES or (kind is int and _INT_MIN <= item <= _UINT64_MAX):
                out[key] = item
            else:
                out[key] = _to_wire(item, f"{path}.{key}", frames, depth + 1)
        return out
    if isinstance(value, list | tuple):
        items: list[Any] = []
        for i, item in enumerate(value):
            kind = type(item)
            if kind in _PLAIN_TYPES or (kind is int and _INT_MIN <= item <= _UINT64_MAX):
                items.append(item)
            else:
                items.append(_to_wire(item, f"{path}[{i}]", frames, depth + 1))
        return items
    raise ValueError(f"{path}: cannot send a value of type {type(value).__name__}")


# ---------------------------------------------------------------------------- decoding


def decode_request(frames: Sequence[FrameLike], limits: Limits = DEFAULT_LIMITS) -> Request:
    """Validate and decode a single request (not a bundle). Raises :class:`DecodeError`
    and nothing else."""
    return _decode_one(frames, limits, _Decoder.request)


def decode_reply(frames: Sequence[FrameLike], limits: Limits = DEFAULT_LIMITS) -> Reply:
    """Validate and decode a single reply (not a bundle). Raises :class:`DecodeError`
    and nothing else."""
    return _decode_one(frames, limits, _Decoder.reply)


def decode_requests(
    frames: Sequence[FrameLike], limits: Limits = DEFAULT_LIMITS
) -> list[Request | DecodeError]:
    """The requests of a message: its envelope's, or each envelope's of a bundle.

    Raises :class:`DecodeError` when the message as a whole cannot be read. An
    envelope of a bundle that fails its checks is a :class:`DecodeError` in its
    place (with its id when the id could be read); the others are unaffected.
    """
    return _decode_each(frames, limits, _Decoder.request)


def decode_replies(
    frames: Sequence[FrameLike], limits: Limits = DEFAULT_LIMITS
) -> list[Reply | DecodeError]:
    """The replies of a message, one or a bundle's (as :func:`decode_requests`)."""
    return _decode_each(frames, limits, _Decoder.reply)


def bundle(envelopes: Sequence[bytes]) -> bytes:
    """Frame 0 of a bundle: the msgpack array of envelopes packed already.

    Only messages of one frame (no data frames) may be bundled: data frames are
    numbered over the whole message, and an envelope packed alone numbers its own.
    """
    n = len(envelopes)
    if not 1 <= n < 2**16:
        raise ValueError(f"a bundle holds 1 to 65535 envelopes, not {n}")
    header = bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
    return header + b"".join(envelopes)


#: The largest bundle graphlane's senders make (client requests, worker replies):
#: far below any reader's ``Limits.max_envelope_bytes``, which a bundle's frame 0
#: must keep as a whole.
BUNDLE_BYTES = 64 * 1024


def bundles(envelopes: Sequence[bytes], max_bytes: int = BUNDLE_BYTES) -> list[tuple[int, bytes]]:
    """Frame 0 of each message that carries ``envelopes`` in order, with how many
    envelopes it carries: several as bundles of at most ``max_bytes``, an envelope
    that fits with no other (or is larger than ``max_bytes``) alone, as itself."""
    out: list[tuple[int, bytes]] = []
    start = size = 0
    for i, envelope in enumerate(envelopes):
        if i > start and size + len(envelope) > max_bytes:
            out.append(_message_of(envelopes[start:i]))
            start, size = i, 0
        size += len(envelope)
    if start < len(envelopes):
        out.append(_message_of(envelopes[start:]))
    return out


def _message_of(envelopes: Sequence[bytes]) -> tuple[int, bytes]:
    return len(envelopes), envelopes[0] if len(envelopes) == 1 else bundle(envelopes)


_Item = TypeVar("_Item", Request, Reply)


def _frozen(cls: type[_Item], **values: Any) -> _Item:
    """An instance of frozen dataclass ``cls`` with ``values`` (every field, checked
    by the caller) set at once: its __init__ sets each through object.__setattr__."""
    item: _Item = object.__new__(cls)
    item.__dict__.update(values)
    return item


def _decode_one(
    frames: Sequence[FrameLike], limits: Limits, read: Callable[[_Decoder, Any], _Item]
) -> _Item:
    decoder = _Decoder(limits)
    try:
        item = read(decoder, decoder.open(frames))
        decoder.check_all_frames_used()
        return item
    except DecodeError:
        raise
    except Exception as exc:  # a bug in the checks must not escape as anything else
        raise decoder.unexpected(exc) from exc


def _decode_each(
    frames: Sequence[FrameLike], limits: Limits, read: Callable[[_Decoder, Any], _Item]
) -> list[_Item | DecodeError]:
    decoder = _Decoder(limits)
    try:
        try:
            top = decoder.open(frames)
        except DecodeError as exc:  # a bundle over a limit: answer each id it holds
            ids = None
            if decoder.buffers and decoder.request_id is None:
                ids = _peek_bundle_ids(decoder.buffers[0], limits)
            if ids is None:
                raise
            return _for_each_id(exc, ids)
        if type(top) is not list:
            item = read(decoder, top)
            decoder.check_all_frames_used()
            return [item]
        if not top:
            decoder.fail("bundle: an empty array of envelopes")
        out: list[_Item | DecodeError] = []
        for envelope in top:
            decoder.request_id = None
            try:
                out.append(read(decoder, envelope))
            except DecodeError as exc:
                out.append(exc)
            except Exception as exc:
                out.append(decoder.unexpected(exc))
        decoder.request_id = None
        try:
            decoder.check_all_frames_used()
        except DecodeError as exc:  # the whole message is wrong: every readable id hears it
            return _for_each_id(
                exc, [x.request_id if isinstance(x, DecodeError) else x.id for x in out]
            )
        return out
    except DecodeError:
        raise
    except Exception as exc:
        raise decoder.unexpected(exc) from exc


def _for_each_id(exc: DecodeError, ids: list[int | None]) -> list[Any]:
    """``exc``, a failure of a whole bundle, as the answer to each of its requests."""
    return [DecodeError(exc.message, code=exc.code, request_id=i) for i in ids]


class _Decoder:
    """The state of one decode: the frames, which of them tensors used, the id once read."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.buffers: list[memoryview] = []
        self.used: set[int] = set()
        self.request_id: int | None = None

    def fail(self, message: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> NoReturn:
        raise DecodeError(message, code=code, request_id=self.request_id)

    def unexpected(self, exc: Exception) -> DecodeError:
        message = f"cannot decode message: {type(exc).__name__}: {exc}"
        return DecodeError(message, request_id=self.request_id)

    # -- envelope

    def open(self, frames: Sequence[FrameLike]) -> Any:
        """Check sizes and unpack frame 0: an envelope, or a bundle's array of them."""
        self.buffers = _as_buffers(frames)
        limits = self.limits
        if not self.buffers:
            self.fail("message has no frames")
        envelope_bytes = self.buffers[0].nbytes
        if envelope_bytes > limits.max_envelope_bytes:
            if envelope_bytes <= _PEEK_FACTOR * limits.max_envelope_bytes:
                self.request_id = _peek_id(self.buffers[0])
            self.fail(
                f"envelope is {envelope_bytes} bytes, over the limit of "
                f"{limits.max_envelope_bytes} (Limits.max_envelope_bytes)"
            )
        if len(self.buffers) > limits.max_frames:
            self.request_id = _peek_id(self.buffers[0])
            self.fail(f"{len(self.buffers)} frames, over the limit of {limits.max_frames}")
        total = envelope_bytes if len(self.buffers) == 1 else sum(b.nbytes for b in self.buffers)
        if total > limits.max_message_bytes:
            self.request_id = _peek_id(self.buffers[0])
            self.fail(f"message is {total} bytes, over the limit of {limits.max_message_bytes}")
        try:
            env = msgpack.unpackb(
                self.buffers[0],
                raw=False,
                strict_map_key=True,
                use_list=True,
                max_str_len=limits.max_str_bytes,
                max_bin_len=limits.max_envelope_bytes,
                max_array_len=limits.max_items,
                max_map_len=limits.max_items,
                max_ext_len=limits.max_envelope_bytes,
            )
        except Exception as exc:
            # Over a limit, or not msgpack: tell the sender if its id can still be read.
            self.request_id = _peek_id(self.buffers[0])
            self.fail(f"envelope: not valid msgpack or over a limit: {type(exc).__name__}: {exc}")
        return env

    def envelope(self, env: Any) -> dict[Any, Any]:
        """Check that ``env`` is an envelope map; read its id, then its version."""
        if type(env) is not dict:
            self.fail(f"envelope: must be a map, got {_describe(env)}")
        self.request_id = self._read_id(env)
        self._check_version(env)
        return env

    def request(self, env: Any) -> Request:
        request_id = _plain_id(env, _REQUEST_KEYS)  # checked flat; anything else as below
        if request_id is not None and type(op := env["op"]) is str and op:
            self.request_id = request_id
            return _frozen(Request, id=request_id, op=op, body=self.body(env["body"]))
        env = self.envelope(env)
        request_id = self.request_id
        assert request_id is not None
        op = self.require(env, "op")
        if not isinstance(op, str) or not op:
            self.fail(f"op: must be a non-empty str, got {_describe(op)}")
        body = self.require(env, "body")
        self.check_keys(env, _REQUEST_KEYS)
        return Request(id=request_id, op=op, body=self.body(body))

    def reply(self, env: Any) -> Reply:
        request_id = _plain_id(env, _REPLY_OK_KEYS)  # checked flat; anything else as below
        if request_id is not None and env["ok"] is True:
            self.request_id = request_id
            body = self.body(env["body"])
            return _frozen(Reply, id=request_id, ok=True, body=body, error=None)
        env = self.envelope(env)
        request_id = self.request_id
        assert request_id is not None
        ok = self.require(env, "ok")
        if not isinstance(ok, bool):
            self.fail(f"ok: must be a bool, got {_describe(ok)}")
        if ok:
            body = self.require(env, "body")
            self.check_keys(env, _REPLY_OK_KEYS)
            return Reply(id=request_id, ok=True, body=self.body(body), error=None)
        error = self.require(env, "error")
        if not isinstance(error, dict):
            self.fail(f"error: must be a map, got {_describe(error)}")
        self.check_keys(env, _REPLY_ERROR_KEYS)
        return Reply(id=request_id, ok=False, body={}, error=error_from_wire(error))

    def _read_id(self, env: dict[Any, Any]) -> int:
        if "id" not in env:
            self.fail("id: missing envelope field")
        request_id = env["id"]
        if not _is_uint64(request_id):
            self.fail(f"id: must be an int in 0..2**64-1, got {_describe(request_id)}")
        assert isinstance(request_id, int)
        return request_id

    def _check_version(self, env: dict[Any, Any]) -> None:
        if "v" not in env:
            self.fail("v: missing envelope field")
        version = env["v"]
        if isinstance(version, bool) or not isinstance(version, int) or version != PROTOCOL_VERSION:
            self.fail(
                f"v: protocol version {_describe(version)} is not supported (this peer speaks "
                f"{PROTOCOL_VERSION})",
                ErrorCode.UNSUPPORTED_VERSION,
            )

    def require(self, env: dict[Any, Any], key: str) -> Any:
        if key not in env:
            self.fail(f"{key}: missing envelope field")
        return env[key]

    def check_keys(self, env: dict[Any, Any], allowed: frozenset[str]) -> None:
        for key in env:
            if key not in allowed:
                self.fail(f"{_key_text(key)}: unknown envelope field (known: {sorted(allowed)})")

    def check_all_frames_used(self) -> None:
        unused = [i for i in range(1, len(self.buffers)) if i not in self.used]
        if unused:
            self.fail(f"extra frames: {unused} are not referenced by any tensor")

    # -- body

    def body(self, body: Any) -> dict[str, Any]:
        if type(body) is not dict:
            self.fail(f"body: must be a map, got {_describe(body)}")
        try:
            decoded = self.container(body, 1)
        except _Fault as fault:
            self.fail(f"body{fault.path()}: {fault.message}")
        if type(decoded) is not dict:
            self.fail("body: must be a map of fields, not a tensor")
        return decoded

    # The walk replaces tensor maps in place: the containers are fresh from msgpack
    # and nobody else holds them. Scalars (exact msgpack types) are skipped without a
    # call. Paths are not tracked on the way down: a _Fault collects the path of the
    # bad value on its way up, so only a failure pays for formatting one.

    def container(self, value: Any, depth: int) -> Any:  # a dict or a list
        limits = self.limits
        if depth > limits.max_depth:
            raise _Fault(f"nested deeper than {limits.max_depth} levels")
        if len(value) > limits.max_items:  # msgpack bounds this too; kept for clarity
            raise _Fault(f"{len(value)} items, over the limit of {limits.max_items}")
        if type(value) is list:
            for i, item in enumerate(value):
                if type(item) not in _SCALAR_TYPES:
                    try:
                        value[i] = self.child(item, depth + 1)
                    except _Fault as fault:
                        fault.under(f"[{i}]")
                        raise
            return value
        if TENSOR_KEY in value:
            return self.tensor(value)
        for key, item in value.items():
            if type(key) is not str:
                raise _Fault(f"map keys must be str, got {type(key).__name__}")
            if type(item) not in _SCALAR_TYPES:
                if type(item) is list and depth < limits.max_depth:
                    for x in item:  # a flat list of scalars (lengths, names): nothing to do
                        if type(x) not in _SCALAR_TYPES:
                            break
                    else:  # (msgpack bounded its length already)
                        continue
                try:
                    # A tensor map within the depth bound goes straight to tensor().
                    if type(item) is dict and TENSOR_KEY in item and depth < limits.max_depth:
                        value[key] = self.tensor(item)
                    else:
                        value[key] = self.child(item, depth + 1)
                except _Fault as fault:
                    fault.under(f".{_key_text(key)}")
                    raise
        return value

    def child(self, item: Any, depth: int) -> Any:
        kind = type(item)
        if kind is dict or kind is list:
            return self.container(item, depth)
        raise _Fault(f"values of type {kind.__name__} are not accepted")

    def tensor(self, wrapper: dict[Any, Any]) -> torch.Tensor:
        if len(wrapper) != 1:
            raise _Fault(f"a {TENSOR_KEY} map must have no other keys")
        spec = wrapper[TENSOR_KEY]
        if type(spec) is not dict:
            raise _Fault(f"must be a map, got {_describe(spec)}", f".{TENSOR_KEY}")
        if not spec.keys() <= _TENSOR_FIELDS:
            for key in spec:
                if key not in _TENSOR_FIELDS:
                    raise _Fault("unknown tensor field", f".{_key_text(key)}")
        name = spec.get("dtype")
        dtype = DTYPES.get(name) if type(name) is str else None
        if dtype is None:
            dtype = self._dtype(spec)  # raises, naming the field
        shape = spec.get("shape")
        if type(shape) is not list or len(shape) > self.limits.max_tensor_dims:
            shape = self._shape(spec)  # raises, naming the field
        for dim in shape:
            if type(dim) is not int or dim < 0:  # msgpack gives exact ints (never bools)
                self._shape(spec)  # raises, naming the dim
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.limits.max_tensor_bytes:
            raise _Fault(
                f"{shape} of {dtype} is {nbytes} bytes, over the limit of "
                f"{self.limits.max_tensor_bytes}",
                ".shape",
            )
        if ("frame" in spec) == ("data" in spec):
            raise _Fault("needs exactly one of 'frame' and 'data'")
        if "frame" not in spec:  # inline: a small copy of its own, writable and aligned
            data = spec["data"]
            if type(data) is not bytes:
                raise _Fault(f"must be bin, got {_describe(data)}", ".data")
            if len(data) != nbytes:
                raise _Fault(
                    f"has {len(data)} bytes, shape {shape} of {dtype} needs {nbytes}", ".data"
                )
            if not nbytes:
                return torch.empty(shape, dtype=dtype)
            np_dtype = _NUMPY_DTYPES.get(dtype)
            if np_dtype is None:  # bfloat16: numpy has none, torch reads the bytes
                flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                return flat.view(dtype).reshape(shape)
            # numpy's view of a fresh copy: the cheapest way to a small tensor
            array = np.ndarray(shape, np_dtype, bytearray(data))
            if dtype is torch.bool and bool((array.view(np.uint8) > 1).any()):
                raise _Fault("bool tensor bytes must be 0 or 1", ".data")
            return torch.from_numpy(array)
        buf = self._frame(spec["frame"])
        if buf.nbytes != nbytes:
            raise _Fault(
                f"has {buf.nbytes} bytes, shape {shape} of {dtype} needs {nbytes}", ".frame"
            )
        return self._view(buf, dtype, shape)

    @staticmethod
    def _dtype(spec: dict[Any, Any]) -> torch.dtype:
        name = spec.get("dtype")
        dtype = DTYPES.get(name) if type(name) is str else None
        if dtype is None:
            raise _Fault(f"must be one of {sorted(DTYPES)}, got {_describe(name)}", ".dtype")
        return dtype

    def _shape(self, spec: dict[Any, Any]) -> list[int]:
        shape = spec.get("shape")
        if type(shape) is not list:
            raise _Fault(f"must be a list of ints, got {_describe(shape)}", ".shape")
        if len(shape) > self.limits.max_tensor_dims:
            raise _Fault(
                f"{len(shape)} dims, over the limit of {self.limits.max_tensor_dims}", ".shape"
            )
        for i, dim in enumerate(shape):
            if type(dim) is not int or dim < 0:  # msgpack gives exact ints (never bools)
                raise _Fault(f"must be an int >= 0, got {_describe(dim)}", f".shape[{i}]")
        return shape

    def _frame(self, index: Any) -> memoryview:
        last = len(self.buffers) - 1
        if type(index) is not int or not 1 <= index <= last:
            raise _Fault(
                f"must be a frame index in 1..{last}, got {_describe(index)}", ".frame"
            )
        if index in self.used:
            raise _Fault(f"frame {index} is referenced by another tensor", ".frame")
        self.used.add(index)
        return self.buffers[index]

    @staticmethod
    def _view(buf: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        if buf.nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if buf.readonly:
            with warnings.catch_warnings():
                # frombuffer warns that a read-only buffer (bytes) gives a writable
                # tensor; decoded tensors are documented as read-only.
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(buf, dtype=torch.uint8)
        else:  # a received zmq frame or a bytearray: no warning to silence
            flat = torch.frombuffer(buf, dtype=torch.uint8)
        if flat.data_ptr() % dtype.itemsize:
            flat = flat.clone()  # misaligned buffer: an aligned copy is the only safe view
        if dtype == torch.bool and bool((flat > 1).any()):
            raise _Fault("bool tensor bytes must be 0 or 1", ".frame")
        return flat.view(dtype).reshape(shape)


def _plain_id(env: Any, keys: frozenset[str]) -> int | None:
    """The id of ``env`` when it is a map of exactly ``keys`` whose id and version are
    valid exact ints (the common case, checked in one expression); None for anything
    else, which the full checks of _Decoder.envelope then report."""
    if (
        type(env) is dict
        and env.keys() == keys
        and type(request_id := env["id"]) is int
        and 0 <= request_id <= _UINT64_MAX
        and type(env["v"]) is int
        and env["v"] == PROTOCOL_VERSION
    ):
        return request_id
    return None


class _Fault(Exception):
    """A bad value found by the body walk: ``message`` about the value at ``where``
    under the container the walk was in; each container on the way up adds its
    step to the path (``under``), and :meth:`_Decoder.body` reports the whole."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.steps = [where]

    def under(self, step: str) -> None:
        self.steps.append(step)

    def path(self) -> str:
        return "".join(reversed(self.steps))


_NUMPY_DTYPES: dict[torch.dtype, Any] = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.bool: np.bool_,
}


def _as_buffers(frames: Sequence[FrameLike]) -> list[memoryview]:
    if type(frames) is not list and (  # a list (what zmq gives) needs no more checks
        isinstance(frames, bytes | bytearray | memoryview | str) or not isinstance(frames, Sequence)
    ):
        raise DecodeError(f"frames must be a sequence of buffers, got {type(frames).__name__}")
    buffers = []
    for i, frame in enumerate(frames):
        try:
            if isinstance(frame, zmq.Frame):  # flat bytes already
                buffers.append(frame.buffer)
                continue
            view = memoryview(frame)
            if type(frame) is bytes:  # flat bytes already
                buffers.append(view)
                continue
            if not view.c_contiguous:
                view = memoryview(view.tobytes())
            if view.ndim != 1 or view.format != "B":
                view = view.cast("B")
        except (TypeError, ValueError) as exc:
            raise DecodeError(f"frame {i}: not a byte buffer ({exc})") from exc
        buffers.append(view)
    return buffers


def _peek_id(envelope: memoryview) -> int | None:
    """The id of an envelope that failed a check, if it can be read cheaply; never raises."""
    try:
        return _id_of_map(_unpacker(envelope), whole=False)
    except Exception:
        return None


#: A frame 0 over the envelope limit by at most this factor is still read for ids
#: (one copy of it), so that its sender hears why; a larger one is dropped unread.
_PEEK_FACTOR = 4


def _peek_bundle_ids(frame: memoryview, limits: Limits) -> list[int | None] | None:
    """The ids of the envelopes of a bundle that failed to unpack as a whole (None
    for an envelope without a readable id); None when ``frame`` is not a readable
    array of at most ``limits.max_items``, or too large to read. Never raises."""
    if frame.nbytes > _PEEK_FACTOR * limits.max_envelope_bytes:
        return None
    try:
        unpacker = _unpacker(frame)
        n = unpacker.read_array_header()
        if not 1 <= n <= limits.max_items:
            return None
        ids: list[int | None] = []
        for _ in range(n):
            try:
                ids.append(_id_of_map(unpacker, whole=True))
            except ValueError:  # not a map (nothing read): skip the element
                unpacker.skip()
                ids.append(None)
        return ids
    except Exception:
        return None


def _unpacker(frame: memoryview) -> msgpack.Unpacker:
    unpacker = msgpack.Unpacker(
        raw=False, strict_map_key=False, max_buffer_size=max(frame.nbytes, 1)
    )
    unpacker.feed(frame)
    return unpacker


def _id_of_map(unpacker: msgpack.Unpacker, *, whole: bool) -> int | None:
    """The "id" of the next value, a map, when that is a uint64; reads up to the id
    (the rest may be truncated) or, ``whole``, the whole map. Raises ValueError,
    having read nothing, when the next value is not a map."""
    found: int | None = None
    for _ in range(unpacker.read_map_header()):
        if unpacker.unpack() == "id" and found is None:
            value = unpacker.unpack()
            found = value if _is_uint64(value) else None
            if not whole:
                return found
        else:
            unpacker.skip()
    return found


def _is_uint64(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= _UINT64_MAX


def _describe(value: Any) -> str:
    """A short description of a received value for error messages."""
    if isinstance(value, str | bytes | int | float | bool) or value is None:
        text = repr(value)
        return text if len(text) <= 40 else f"{text[:37]}..."
    return type(value).__name__


def _key_text(key: Any) -> str:
    text = key if isinstance(key, str) else repr(key)
    return text if len(text) <= 64 else f"{text[:61]}..."
