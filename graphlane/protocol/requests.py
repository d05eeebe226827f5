"""Requests read in one pass, envelope and body together (the worker's socket loop).

:func:`graphlane.protocol.wire.decode_requests` reads a request in two steps, the
envelope (its body kept as bytes) and then the body with its op's type, so that
whatever is wrong is said precisely and with the request's id. Most requests
are fine: :func:`decode_requests` reads each envelope once, through a tagged union
of one envelope type per op (``op`` is the tag) whose ``body`` has that op's
type, and hands out the :class:`~graphlane.protocol.wire.Request` with its body
decoded already. Whatever that one pass does not accept (an unknown op, another
protocol version, a missing body, any field out of its bounds, a tensor that does
not fit its frames) is read again the two-step way, which answers it exactly as
it always did; so the two functions give the same requests and the same errors.
A bundle's envelopes are read the same way, all at once. Typed through and through,
the one pass reads no deeper than the types allow; the two-step way walks what it
reads untyped first (:mod:`.admission`).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, Union

import msgspec

from graphlane.protocol.admission import check_sizes, unreadable
from graphlane.protocol.bounds import RequestId
from graphlane.protocol.ops import OPS
from graphlane.protocol.tensors import TENSOR_FIELDS, Frames, with_tensors
from graphlane.protocol.wire import (
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    DecodeError,
    FrameLike,
    Limits,
    Request,
    _bundle,
    _envelopes,
    _request,
)

# One envelope type per op: {"v", "id", "op": <its name>, "body": <its body type>}.
_ENVELOPES = {
    msgspec.defstruct(
        f"_{name.title().replace('_', '')}Envelope",
        [("v", int), ("id", RequestId), ("body", op.request)],
        tag_field="op",
        tag=name,
        forbid_unknown_fields=True,
        frozen=True,
    ): name
    for name, op in OPS.items()
}
_ANY_ENVELOPE: Any = Union[tuple(_ENVELOPES)]  # noqa: UP007
_any_envelope: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(_ANY_ENVELOPE)
_any_bundle: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    types.GenericAlias(list, _ANY_ENVELOPE)  # list[_ANY_ENVELOPE], built at run time
)
# Typed through and through, these read no deeper than their types (a request nests at
# most 6 levels), but for the values msgspec skips to find the tag when ``op`` comes
# late: a skip too deep is a RecursionError (msgspec's skip costs little stack), and the
# message is then read the careful way, walked first (wire._envelopes).


def decode_requests(
    frames: Sequence[FrameLike], limits: Limits = DEFAULT_LIMITS
) -> list[Request | DecodeError]:
    """What :func:`graphlane.protocol.wire.decode_requests` returns for ``frames``, with
    each request's body decoded already. Raises DecodeError as it does."""
    try:
        buffers = check_sizes(frames, limits)
        typed = _typed(buffers, limits)
        if typed is not None:
            return typed
        return [
            _one_pass(raw, data) or _request(raw, data.fresh())
            if type(raw) is not DecodeError
            else raw
            for raw, data in _envelopes(buffers, limits)
        ]
    except DecodeError:
        raise
    except Exception as exc:
        raise unreadable(frames, exc) from None


def _typed(buffers: list[memoryview], limits: Limits) -> list[Request | DecodeError] | None:
    """The requests of a message whose every envelope reads in one pass (the common
    case, a bundle's at once); None when one must be read the careful way."""
    head = buffers[0]
    if not _bundle(head):
        request = _one_pass(head, Frames(buffers[1:], limits))
        return None if request is None else [request]
    if len(buffers) > 1:
        return None
    try:
        envs = _any_bundle.decode(head)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    if not 0 < len(envs) <= limits.max_items:
        return None
    none = Frames((), limits)  # with no frames it never changes
    out: list[Request | DecodeError] = []
    for env in envs:
        request = _accepted(env, b"", none)
        if request is None:
            return None
        out.append(request)
    return out


def _one_pass(raw: Any, frames: Frames) -> Request | None:
    """The request, body decoded; None when the two-step reading must say what is wrong."""
    try:
        env = _any_envelope.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    return _accepted(env, raw, frames)


def _accepted(env: Any, raw: Any, frames: Frames) -> Request | None:
    if env.v != PROTOCOL_VERSION:
        return None
    body = env.body
    fields = TENSOR_FIELDS.get(type(body))
    try:
        if fields is not None:
            body = with_tensors(body, fields, frames)
        frames.check_all_used()
    except ValueError:
        return None
    return Request(env.id, _ENVELOPES[type(env)], raw, frames, body)


__all__ = ["decode_requests"]
