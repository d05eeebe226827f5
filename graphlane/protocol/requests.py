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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import msgspec

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
_any_envelope: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    Union[tuple(_ENVELOPES)]  # noqa: UP007
)


def decode_requests(
    frames: Sequence[FrameLike], limits: Limits = DEFAULT_LIMITS
) -> list[Request | DecodeError]:
    """What :func:`graphlane.protocol.wire.decode_requests` returns for ``frames``, with
    each request's body decoded already. Raises DecodeError as it does."""
    return [
        _one_pass(raw, data) or _request(raw, data.fresh())
        if type(raw) is not DecodeError
        else raw
        for raw, data in _envelopes(frames, limits)
    ]


def _one_pass(raw: Any, frames: Frames) -> Request | None:
    """The request, body decoded; None when the two-step reading must say what is wrong."""
    try:
        env = _any_envelope.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
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
