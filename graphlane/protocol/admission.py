"""Admission: what a receiver takes, checked before a decoder reads anything.

A decoder trusts what it reads: msgspec and msgpack recurse as deep as a value nests
(msgspec refuses a value about a thousand levels deep only once the stack is that
deep: a RecursionError, or a crash on a thread with a small stack) and skip or
build whatever a header declares. So before any decoder sees a message:

* its frame count and sizes are checked against :class:`Limits` (the message's
  bytes, its envelope's, its frame count): over them it is refused TOO_LARGE, and
  :func:`early_id` reads, from the first bytes alone, the id to answer;
* what is read untyped (an envelope whose body is kept as bytes, a bundle's
  envelopes, an untyped reply body: see :func:`untyped`) is walked (:func:`walk`):
  its headers read in a loop with a list for a stack, nothing decoded, a declared
  length compared with the bytes that remain, never allocated; nested deeper than
  ``Limits.max_depth`` or with more than ``Limits.max_items`` entries in an array or
  map, it is refused (BAD_REQUEST), and :func:`scan_id` reads the id to answer with
  msgpack's reader, whose stack is a fixed array. What a typed decode reads is
  bounded by its type; walking costs Python time per value, so only untyped reads
  are walked.

A socket's ``ZMQ_MAXMSGSIZE`` (libzmq cuts the connection of a peer that sends a
larger frame, with no reply, having held the whole message) is set to the
receiver's ``max_message_bytes``: no frame of an acceptable message is larger, and
it is the most memory one frame may cost the receiver. Under it every limit is
checked here and answered TOO_LARGE (not retryable), and the connection stays up.
Over it nothing can be answered, so senders check first: graphlane's client checks
each message against the limits the daemon's hello gives (:func:`check_outgoing`)
and raises TOO_LARGE without sending, so its connection and the calls in flight on
it never meet the cut.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import msgspec
import msgspec.inspect
import zmq

from graphlane.logs import Throttled
from graphlane.protocol.bounds import MAX_ITEMS
from graphlane.protocol.errors import ErrorCode, GraphlaneError, TooLarge, error_class


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts: frame counts and sizes (checked before decoding), the
    shape of what is read untyped (``max_depth``: the envelope is level 1, a map in its
    body level 2; ``max_items``: entries of one array or map, a bundle's envelopes too),
    tensors (checked as they are read). Typed fields have tighter bounds of their own
    (:mod:`.bounds`, :mod:`.ops`): a request nests at most 6 deep and holds at most
    ``bounds.MAX_ITEMS`` entries per list, hence the minimums."""

    max_message_bytes: int = 256 * 2**20  # sum of all frames
    max_frames: int = 64  # envelope included
    max_envelope_bytes: int = 1 * 2**20  # frame 0
    max_tensor_bytes: int = 256 * 2**20
    max_tensor_dims: int = 8
    max_depth: int = 32  # nesting of containers in one envelope
    max_items: int = 65536  # entries of one array or map
    #: requests of one bundle: a bundle of more is refused unread, before any is answered
    #: (a bundle is handled in one turn of the socket loop, and each request may ask for
    #: a reply ~100 times its size: ``status``)
    max_bundle: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{f.name} must be an int >= 1, got {value!r}")
        for name, least in (("max_depth", 8), ("max_items", MAX_ITEMS)):
            if getattr(self, name) < least:
                raise ValueError(
                    f"Limits.{name} must be >= {least} (what a valid request may need)"
                )


DEFAULT_LIMITS = Limits()
CONTROL_LIMITS = Limits(max_message_bytes=4 * 2**20, max_tensor_bytes=4 * 2**20)
"""The daemon's control socket: requests without tensors, envelopes up to 1 MiB answered,
frames over 4 MiB cut (a control socket holds no more than that for anyone)."""


class DecodeError(Exception):
    """A message that cannot be accepted: ``request_id`` is set when the id could
    be read (the sender then gets ``code``), else the message is only counted;
    ``op`` when the envelope was read and only its body is wrong."""

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode = ErrorCode.BAD_REQUEST,
        request_id: int | None = None,
        op: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.request_id = request_id
        self.op = op

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def to_error(self) -> GraphlaneError:
        return error_class(self.code)(self.message)


# ------------------------------------------------------------------ sizes
def check_sizes(frames: Sequence[Any], limits: Limits) -> list[memoryview]:
    """The frames as byte views, their count and sizes within ``limits``; else
    DecodeError (TOO_LARGE, to the id the envelope names in its first bytes)."""
    if not frames:
        raise DecodeError("no frames")
    if len(frames) > limits.max_frames:
        # (a receiver keeps max_frames + 1 of a longer message: wire.recv_message)
        raise _too_large(frames, f"more than {limits.max_frames} frames")
    try:
        buffers = [_buffer(f) for f in frames]
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"a frame is not a contiguous byte buffer: {exc}") from None
    if buffers[0].nbytes > limits.max_envelope_bytes:
        raise _too_large(
            frames, f"envelope of {buffers[0].nbytes} bytes, at most {limits.max_envelope_bytes}"
        )
    if len(buffers) > 1:
        total = sum(b.nbytes for b in buffers)
        if total > limits.max_message_bytes:
            limit = limits.max_message_bytes
            raise _too_large(frames, f"message of {total} bytes, at most {limit}")
    return buffers


def _too_large(frames: Sequence[Any], message: str) -> DecodeError:
    return DecodeError(message, code=ErrorCode.TOO_LARGE, request_id=_early_id(frames))


def _early_id(frames: Sequence[Any]) -> int | None:
    """The id an envelope names in its first bytes, if it is one (see :func:`early_id`)."""
    try:
        return early_id(_buffer(frames[0]))
    except (IndexError, TypeError, ValueError):
        return None


def _buffer(frame: Any) -> memoryview:
    view = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
    # A view of bytes, whatever the exporter's format: len() counts bytes.
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def check_outgoing(frames: Sequence[Any], limits: Limits) -> None:
    """TooLarge if a receiver with ``limits`` would refuse ``frames`` by their size (a
    sender's check: see the module docstring)."""
    if len(frames) > limits.max_frames:
        raise TooLarge(f"{len(frames)} frames, at most {limits.max_frames}")
    head = len(frames[0])  # bytes: the encoder's envelope
    if head > limits.max_envelope_bytes:
        raise TooLarge(
            f"an envelope of {head} bytes, at most {limits.max_envelope_bytes} "
            "(params this large belong in tensors)"
        )
    if len(frames) > 1:
        total = head + sum(memoryview(f).nbytes for f in frames[1:])
        if total > limits.max_message_bytes:
            raise TooLarge(
                f"a message of {total} bytes, at most {limits.max_message_bytes} "
                "(send the work in smaller parts)"
            )


# ------------------------------------------------------------------ shapes
@functools.cache
def untyped(kind: Any) -> bool:
    """Whether decoding ``kind`` reads some value whatever its shape (``Any``, ``Raw``)."""
    pending = [msgspec.inspect.type_info(kind)]
    seen: set[int] = set()
    while pending:
        t = pending.pop()
        if isinstance(t, msgspec.inspect.AnyType | msgspec.inspect.RawType):
            return True
        if id(t) in seen:
            continue
        seen.add(id(t))
        for value in msgspec.structs.astuple(t):
            for v in value if isinstance(value, tuple) else (value,):
                v = v.type if isinstance(v, msgspec.inspect.Field) else v
                if isinstance(v, msgspec.inspect.Type):
                    pending.append(v)
    return False


def is_bundle(head: bytes | memoryview) -> bool:
    """Whether a message's first frame is a bundle: a msgpack array (an envelope is a map)."""
    return bool(head) and (0x90 <= head[0] <= 0x9F or head[0] in (0xDC, 0xDD))


def bundle_size(head: memoryview, limits: Limits) -> int:
    """How many envelopes a bundle's header says it holds; DecodeError (TOO_LARGE, no id:
    nobody is answered) for more than ``limits.max_bundle``, read from its first bytes."""
    width = {0xDC: 2, 0xDD: 4}.get(head[0], 0)
    count = int.from_bytes(head[1 : 1 + width], "big") if width else head[0] & 0x0F
    if count > limits.max_bundle:
        raise DecodeError(
            f"a bundle of {count} requests, at most {limits.max_bundle}: send fewer per message",
            code=ErrorCode.TOO_LARGE,
        )
    return count


def bundle_items(head: memoryview, limits: Limits) -> list[tuple[memoryview, str | None]]:
    """A bundle's envelopes, each with the first limit of its shape it breaks (None if
    none: see :func:`walk`). ValueError when the bundle as a whole cannot be read."""
    width = {0xDC: 2, 0xDD: 4}.get(head[0], 0)
    if len(head) < 1 + width:
        raise ValueError("unreadable bundle: its header is cut short")
    count = int.from_bytes(head[1 : 1 + width], "big") if width else head[0] & 0x0F
    if not count:
        raise ValueError("an empty bundle")
    if count > limits.max_items:
        raise ValueError(f"a bundle of {count} envelopes, at most {limits.max_items}")
    items: list[tuple[memoryview, str | None]] = []
    pos = 1 + width
    for i in range(count):
        end, problem = walk(head, pos, limits)
        if end is None:
            raise ValueError(f"unreadable bundle: envelope {i} is cut short or not msgpack")
        items.append((head[pos:end], problem))
        pos = end
    if pos != len(head):
        raise ValueError("unreadable bundle: bytes after its last envelope")
    return items


def refused(raw: memoryview, problem: str) -> DecodeError:
    """The refusal of an envelope whose shape breaks a limit (a BAD_REQUEST to its id)."""
    return DecodeError(f"envelope: {problem}", request_id=scan_id(raw)[0])


# What the first byte of a value says: (kind, n, extra). _SCALAR: n is the value's
# whole size. _SIZED (str, bin, ext): n bytes of length follow, then extra bytes (an
# ext's type), then the data. _ARRAY, _MAP: n bytes of count follow (0: the count is
# the byte's low bits).
_SCALAR, _SIZED, _ARRAY, _MAP, _INVALID = range(5)


def _first_bytes() -> tuple[tuple[int, int, int], ...]:
    kinds = [(_INVALID, 0, 0)] * 256
    for b in (*range(0x00, 0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3):
        kinds[b] = (_SCALAR, 1, 0)  # fixints, nil, false, true
    for b in range(0xA0, 0xC0):
        kinds[b] = (_SCALAR, 1 + (b & 0x1F), 0)  # fixstr
    for b in range(0x80, 0x90):
        kinds[b] = (_MAP, 0, 0)
    for b in range(0x90, 0xA0):
        kinds[b] = (_ARRAY, 0, 0)
    sizes = {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3,
             0xD2: 5, 0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18}  # fmt: skip
    for b, size in sizes.items():
        kinds[b] = (_SCALAR, size, 0)  # numbers, fixext
    for b, n in ((0xC4, 1), (0xC5, 2), (0xC6, 4), (0xD9, 1), (0xDA, 2), (0xDB, 4)):
        kinds[b] = (_SIZED, n, 0)  # bin, str
    for b, n in ((0xC7, 1), (0xC8, 2), (0xC9, 4)):
        kinds[b] = (_SIZED, n, 1)  # ext: a type byte before the data
    kinds[0xDC], kinds[0xDD] = (_ARRAY, 2, 0), (_ARRAY, 4, 0)
    kinds[0xDE], kinds[0xDF] = (_MAP, 2, 0), (_MAP, 4, 0)
    return tuple(kinds)


_KINDS = _first_bytes()


def walk(buf: bytes | memoryview, pos: int, limits: Limits) -> tuple[int | None, str | None]:
    """The end of the msgpack value that starts at ``pos`` in ``buf`` (None when it has
    none: it runs past the end of ``buf``, or meets a byte that starts no value), and
    the first limit it breaks (None if none): nested deeper than ``limits.max_depth``
    (the value itself is level 1), or an array or map of more than ``limits.max_items``
    entries. After a broken limit the walk goes on to the value's end, so that the
    values after it can still be read.

    A value whose end is None and that broke no limit before the point where it
    breaks is safe to hand to a decoder: it fails there, as deep as the walk went."""
    end = len(buf)
    max_depth, max_items = limits.max_depth, limits.max_items
    problem: str | None = None
    left = [1]  # values still to read at each open level; the bottom one is the value
    while left:
        if not left[-1]:
            left.pop()
            continue
        left[-1] -= 1
        if pos >= end:
            return None, problem
        first = buf[pos]
        kind, n, extra = _KINDS[first]
        if kind == _SCALAR:
            pos += n
            continue
        if kind == _INVALID:
            return None, problem
        if n:
            if pos + 1 + n > end:
                return None, problem
            count = int.from_bytes(buf[pos + 1 : pos + 1 + n], "big")
        else:
            count = first & 0x0F
        pos += 1 + n
        if kind == _SIZED:
            pos += extra + count
            continue
        if problem is None:
            if count > max_items:
                what = "an array" if kind == _ARRAY else "a map"
                problem = f"{what} of {count} entries, at most {max_items}"
            elif len(left) > max_depth:
                problem = f"nested deeper than {max_depth} levels"
        left.append(count if kind == _ARRAY else 2 * count)
    return (pos if pos <= end else None), problem


# ------------------------------------------------------------------ ids
_EARLY_BYTES = 4096


def early_id(head: memoryview) -> int | None:
    """The id an envelope names in its first bytes (graphlane's encoder writes ``v``,
    ``id`` and ``op`` first), for a message not read any further; None for a bundle."""
    head = head[:_EARLY_BYTES]
    return None if is_bundle(head) else scan_id(head)[0]


def scan_id(raw: Any) -> tuple[int | None, Any]:
    """The id and ``v`` among a map's first entries, before the point where it breaks
    (a truncated envelope still names its id when the id comes first); ``v`` UNSET when
    not found. msgpack's reader keeps its stack in a fixed array and its lengths within
    the bytes given: nothing here recurses or allocates by a declared size."""
    request_id: int | None = None
    version: Any = msgspec.UNSET
    try:
        unpacker = msgpack.Unpacker(max_buffer_size=len(raw) + 1)
        unpacker.feed(raw)
        for _ in range(min(unpacker.read_map_header(), 16)):
            key = unpacker.unpack()
            if key == "id":
                value = unpacker.unpack()
                ok = type(value) is int and 0 <= value < 2**64
                request_id = value if ok else None
            elif key == "v":
                version = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:  # unreadable from here on: what was found so far
        pass
    return request_id, version


# ------------------------------------------------------------------ the unforeseen
_unexpected_log = Throttled(logging.getLogger("graphlane.protocol"))


def unreadable(frames: Sequence[Any], exc: Exception) -> DecodeError:
    """What a decode that failed in a way nobody foresaw gives (a bug: logged, at most
    once per interval): a BAD_REQUEST to the sender when frame 0 names its id."""
    _unexpected_log.warning(
        "could not read a message (%s: %s)", type(exc).__name__, exc, exc_info=exc
    )
    return DecodeError(f"unreadable message ({type(exc).__name__})", request_id=_early_id(frames))
