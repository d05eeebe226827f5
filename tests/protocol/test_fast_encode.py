"""The worker's fast reply encoding gives the bytes the general path gives."""

from __future__ import annotations

import msgspec
import pytest
import torch

from graphlane.protocol import ops, wire


def _as_dict_envelope(request_id: int, body: object) -> bytes:
    envelope = {"v": wire.PROTOCOL_VERSION, "id": request_id, "ok": True, "body": body}
    wire._local.out = []
    try:
        return wire.encoder().encode(envelope)
    finally:
        wire._local.out = None


@pytest.mark.parametrize(
    "outputs",
    [
        {},
        {"out": torch.arange(16, dtype=torch.float16).reshape(1, 2, 1, 8)},
        {"out": torch.zeros(0, 3), "lse": torch.ones(2, dtype=torch.float32)},
        {"big": torch.randn(64, 64)},  # a frame of its own
        {"t": torch.arange(12, dtype=torch.int32).reshape(3, 4).t()},  # not contiguous
    ],
)
def test_encode_done_is_encode_reply_of_a_step_done(outputs: dict[str, torch.Tensor]) -> None:
    fast = wire.encode_done(7, outputs, 4, 1, 2, 12.5, 3)
    general = wire.encode_reply(7, ops.StepDone(outputs, 4, 1, 2, 12.5, 3))
    assert [bytes(f) for f in fast] == [bytes(f) for f in general]
    reply = wire.decode_replies(fast)[0]
    assert isinstance(reply, wire.Reply)
    done = reply.body(ops.OPS["step"].reply_decoder)
    assert done.bucket == 4 and done.instance == 1 and done.patched == 2
    for name, t in outputs.items():
        assert torch.equal(done.outputs[name], t)


def test_an_ok_envelope_packs_as_its_dict_did() -> None:
    body = {"state": "draining", "inflight": 3}
    assert wire.encode_reply(5, body)[0] == _as_dict_envelope(5, body)
    decoded = msgspec.msgpack.decode(wire.encode_reply(5, body)[0])
    assert list(decoded) == ["v", "id", "ok", "body"]


def test_encode_done_refuses_what_cannot_be_sent() -> None:
    with pytest.raises(ValueError, match="complex64"):
        wire.encode_done(1, {"out": torch.zeros(1, dtype=torch.complex64)}, 0, 0, 0, 0.0, 0)


def _replies(frames: list[object], limits: wire.Limits) -> object:
    try:
        items = wire.decode_replies(frames, limits)  # type: ignore[arg-type]
    except wire.DecodeError as exc:
        return ("refused", exc.message, exc.request_id)
    out: list[object] = []
    for item in items:
        if isinstance(item, wire.DecodeError):
            out.append(("error", item.message, item.code, item.request_id))
        else:
            error = None if item.error is None else (item.error.code, item.error.message)
            out.append((item.id, bytes(item.raw), error, item.frames.count))
    return out


_ok = wire.encode_reply(3, ops.StepDone({"out": torch.ones(2)}, 1))[0]
_error = wire.encode_error(4, wire.DecodeError("bad").to_error())[0]


@pytest.mark.parametrize(
    "frame",
    [
        _ok,
        _error,
        wire.bundle([_ok, _error]),
        b"",
        b"\x93\x01",
        b"\xc1",
        msgspec.msgpack.encode({"v": 1, "id": 5, "ok": True, "body": {}, "x": 1}),
        msgspec.msgpack.encode({"v": 2, "id": 5, "ok": True}),
        b"\xdc\x00\x01" + _ok,
    ],
)
@pytest.mark.parametrize("limit", [1 << 20, 8])
def test_a_one_frame_reply_reads_as_any_other_buffer_does(frame: bytes, limit: int) -> None:
    limits = wire.Limits(max_envelope_bytes=limit)
    assert _replies([frame], limits) == _replies([bytearray(frame)], limits)
