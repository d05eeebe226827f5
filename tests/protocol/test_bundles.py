"""Bundles: a frame 0 that is an array of envelopes, each answered as if it came alone."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch

from graphlane.protocol import (
    BUNDLE_BYTES,
    BUNDLE_MAX,
    DEFAULT_LIMITS,
    OPS,
    Busy,
    Codec,
    DecodeError,
    ErrorCode,
    Limits,
    Reply,
    Request,
    bundle,
    bundles,
    encode_error,
    encode_reply,
    encode_request,
    ops,
)


def decode_requests(frames: Any, limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    return Codec(limits).decode_requests(frames)


def decode_replies(frames: Any, limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    return Codec(limits).decode_replies(frames)


BAD = ErrorCode.BAD_REQUEST


def step(request_id: int, program: str = "attention") -> bytes:
    frames = encode_request(request_id, "step", ops.Step(program, 0, {"i": request_id}))
    assert len(frames) == 1
    return bytes(frames[0])


def refused(item: Any, code: ErrorCode, request_id: int | None, field: str = "") -> None:
    assert isinstance(item, DecodeError), item
    assert (item.code, item.request_id) == (code, request_id), item
    assert field in item.message, item


def refused_unread(frames: list[Any], limits: Limits | None = None, code: ErrorCode = BAD) -> None:
    with pytest.raises(DecodeError) as info:
        decode_requests(frames, limits or Limits())
    refused(info.value, code, None)


def summary(req: Request | DecodeError) -> Any:
    assert isinstance(req, Request), req
    return req.id, req.op, req.body


def foreign_bundle(envelopes: list[bytes]) -> bytes:
    """A bundle as another sender may make it, of any size (an array16 header)."""
    return b"\xdc" + len(envelopes).to_bytes(2, "big") + b"".join(envelopes)


@pytest.mark.parametrize("n", [1, 2, 15, 16, 32, 256])  # fixarray and array16 headers
def test_a_bundle_carries_requests_that_decode_as_if_sent_alone(n: int) -> None:
    envelopes = [step(i + 1) for i in range(n)]
    frame = bundle(envelopes) if n <= BUNDLE_MAX else foreign_bundle(envelopes)
    decoded = decode_requests([frame])
    assert [summary(r) for r in decoded] == [summary(*decode_requests([e])) for e in envelopes]
    assert [r.id for r in decoded if isinstance(r, Request)] == list(range(1, n + 1))


def test_an_array32_header_is_a_bundle_too() -> None:
    (req,) = decode_requests([b"\xdd\x00\x00\x00\x01" + step(3)])
    assert isinstance(req, Request) and req.id == 3


def test_bundle_bounds() -> None:
    with pytest.raises(ValueError):
        bundle([])
    with pytest.raises(ValueError):
        bundle([step(1)] * (BUNDLE_MAX + 1))
    assert len(decode_requests([bundle([step(1)] * BUNDLE_MAX)])) == BUNDLE_MAX
    largest = foreign_bundle([step(1)] * (2**16 - 1))  # a reader may take up to max_items
    limits = Limits(max_envelope_bytes=len(largest), max_bundle=2**16 - 1)
    assert len(decode_requests([largest], limits)) == 2**16 - 1


def test_bundles_packs_envelopes_in_order_into_messages_of_bounded_size() -> None:
    small = [step(i, "a" * 40) for i in range(1, 8)]  # 91 bytes each: two fit with a header
    large = bytes(encode_request(8, "step", ops.Step("b", 0, {"pad": "b" * 160}))[0])
    assert len(small[0]) == 91 and len(large) > 190
    messages = bundles([*small[:2], large, *small[2:]], max_bytes=190)
    assert [count for count, _ in messages] == [2, 1, 2, 2, 1]
    assert messages[1][1] == large  # larger than max_bytes: alone, as itself
    assert all(len(m) <= 190 for i, (_, m) in enumerate(messages) if i != 1)
    ids = [r.id for _, m in messages for r in decode_requests([m]) if isinstance(r, Request)]
    assert ids == [1, 2, 8, 3, 4, 5, 6, 7]
    assert bundles([small[0]]) == [(1, small[0])]
    assert bundles([]) == []


@pytest.mark.parametrize("max_bytes", [185, 182])
def test_the_array_header_counts_toward_max_bytes(max_bytes: int) -> None:
    messages = bundles([step(i, "a" * 40) for i in range(4)], max_bytes)
    assert all(len(m) <= max_bytes for _, m in messages)
    assert [count for count, _ in messages] == ([2, 2] if max_bytes == 185 else [1, 1, 1, 1])


def test_bundles_hold_at_most_the_senders_count() -> None:
    messages = bundles([b"\x80"] * 70, max_bytes=2**30)
    assert [count for count, _ in messages] == [BUNDLE_MAX, BUNDLE_MAX, 70 - 2 * BUNDLE_MAX]


def test_bundles_default_to_the_senders_limit() -> None:
    envelopes = [step(i, "x" * 100) for i in range(1000)]
    messages = bundles(envelopes)
    assert len(messages) > 1 and sum(count for count, _ in messages) == 1000
    assert all(len(m) <= BUNDLE_BYTES for _, m in messages)


def test_a_bad_envelope_in_a_bundle_fails_alone_with_its_id_when_it_can_be_read() -> None:
    wrong_version = msgpack.packb({"v": 9, "id": 2, "op": "step", "body": {}})
    no_id = msgpack.packb({"v": 1, "op": "step", "body": {}})
    not_a_map = msgpack.packb([1, 2])
    bad_field = msgpack.packb({"v": 1, "id": 5, "op": "step", "body": {}, "x": 1})
    bad_body = msgpack.packb({"v": 1, "id": 6, "op": "step", "body": {"program": "p"}})
    a_frame = msgpack.packb(
        {
            "v": 1,
            "id": 7,
            "op": "step",
            "body": {
                "program": "p",
                "device": 0,
                "inputs": {"q": {"$tensor": {"dtype": "int8", "shape": [2], "frame": 1}}},
            },
        }
    )
    out = decode_requests(
        [bundle([step(1), wrong_version, no_id, not_a_map, bad_field, bad_body, a_frame, step(8)])]
    )
    assert isinstance(out[0], Request) and out[0].id == 1
    refused(out[1], ErrorCode.UNSUPPORTED_VERSION, 2)
    refused(out[2], BAD, None, "envelope.id")
    refused(out[3], BAD, None, "envelope")
    refused(out[4], BAD, 5, "envelope.x")
    refused(out[5], BAD, 6, "body.device")
    refused(out[6], BAD, 7, "body.inputs[...]")
    assert isinstance(out[7], Request) and out[7].id == 8


def test_a_bundle_with_data_frames_is_refused_unread() -> None:
    refused_unread([bundle([step(1), step(2)]), b"stray"])


def test_a_bundle_over_the_envelope_limit_is_refused_unread() -> None:
    envelopes = [step(i) for i in range(1, 7)]
    frame = bundle(envelopes)
    assert len(decode_requests([frame], Limits(max_envelope_bytes=len(frame)))) == 6
    # TOO_LARGE for the message, and nobody to answer: a bundle names no one id.
    refused_unread([frame], Limits(max_envelope_bytes=len(frame) - 1), ErrorCode.TOO_LARGE)


@pytest.mark.parametrize("frame", [b"\x90", b"\x92\x80", b"\xdc\x00", b"\x91\xc1"], ids=repr)
def test_empty_or_unreadable_bundles_are_refused_unread(frame: bytes) -> None:
    refused_unread([frame])


def test_replies_bundle_as_requests_do() -> None:
    out = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    done = encode_reply(1, ops.DeviceResult({"out": out}, bucket=2, instance=1))
    error = encode_error(2, Busy("full"))
    assert len(done) == 1 and len(error) == 1  # small tensors travel inline
    broken = msgpack.packb({"v": 1, "id": 3, "ok": True, "body": {}, "x": 0})
    first, second, third = decode_replies([bundle([bytes(done[0]), bytes(error[0]), broken])])
    assert isinstance(first, Reply) and first.id == 1 and first.error is None
    body = first.body(OPS["step"])
    assert torch.equal(body.outputs["out"], out) and (body.bucket, body.instance) == (2, 1)
    assert isinstance(second, Reply) and second.id == 2
    assert second.error is not None and second.error.code == ErrorCode.BUSY
    refused(third, BAD, 3, "envelope.x")
