"""protocol.requests.decode_requests (envelope and body read in one pass, the worker's
socket loop) gives what wire.decode_requests and Request.body give: the same
requests, bodies and errors, for valid messages and for anything else."""

from __future__ import annotations

from typing import Any

import hostile
import msgpack
import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphlane.protocol import ops, requests, wire
from graphlane.protocol.ops import OPS
from graphlane.protocol.tensors import TENSOR_KEY


def plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), list(value.shape), value.numpy().tobytes())
    if isinstance(value, msgspec.Struct):
        return (type(value).__name__, plain(msgspec.structs.asdict(value)))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def error(exc: wire.DecodeError) -> tuple[Any, ...]:
    return ("error", exc.message, exc.code, exc.request_id)


def read(decode: Any, frames: list[Any], limits: wire.Limits) -> Any:
    try:
        items = decode(frames, limits)
    except wire.DecodeError as exc:
        return error(exc)
    out = []
    for item in items:
        if isinstance(item, wire.DecodeError):
            out.append(error(item))
            continue
        body: Any = None
        if item.op in OPS:
            try:
                body = plain(item.body(OPS[item.op].request_decoder))
            except wire.DecodeError as exc:
                body = error(exc)
        out.append((item.id, item.op, body))
    return out


def same(frames: list[Any], limits: wire.Limits = wire.DEFAULT_LIMITS) -> Any:
    fast = read(requests.decode_requests, frames, limits)
    assert fast == read(wire.decode_requests, frames, limits)
    return fast


def _step(**changes: Any) -> ops.Step:
    fields: dict[str, Any] = dict(
        program="attention", device=0, params={"actual_seq_lengths_kv": [3, 1]}, outputs=["out"]
    )
    return ops.Step(**{**fields, **changes})


VALID = [
    wire.encode_request(1, "step", _step()),
    wire.encode_request(2, "step", _step(inputs={"query": torch.randn(2, 4, 1, 8).half()})),
    wire.encode_request(3, "step", _step(inputs={"key": torch.randn(64, 64)})),  # a frame
    wire.encode_request(4, "update", ops.Update("attention", 0, {"x": 1}, batch=2)),
    wire.encode_request(5, "replay", ops.Replay("attention", 0, 2, ["out"])),
    wire.encode_request(6, "hello", ops.Hello(client="c")),
    wire.encode_request(7, "status", ops.Status()),
    wire.encode_request(
        8, "kv_write", ops.KvWrite("p", 0, torch.arange(2), torch.ones(1, 2, 1, 4), torch.ones(2))
    ),
]


@pytest.mark.parametrize("frames", VALID)
def test_valid_requests_read_alike(frames: list[Any]) -> None:
    [(request_id, _op, body)] = same(frames)
    assert request_id >= 1 and body[0] != "error"


def test_a_valid_request_comes_with_its_body_decoded() -> None:
    [req] = requests.decode_requests(VALID[0])
    assert isinstance(req, wire.Request) and isinstance(req.decoded, ops.Step)


def _packed(env: dict[str, Any], *extra: bytes) -> list[bytes]:
    return [msgpack.packb(env, use_bin_type=True), *extra]


STEP_BODY = {"program": "attention", "device": 0, "params": {"actual_seq_lengths_kv": [3]}}
INVALID = [
    _packed({"v": 1, "id": 9, "op": "nope", "body": {}}),  # unknown op
    _packed({"v": 2, "id": 9, "op": "step", "body": STEP_BODY}),  # another version
    _packed({"v": True, "id": 9, "op": "step", "body": STEP_BODY}),
    _packed({"v": 1, "id": 9, "op": "step"}),  # no body
    _packed({"v": 1, "id": 9, "op": "status"}),  # no body, none needed
    _packed({"v": 1, "id": 9, "op": "step", "body": {**STEP_BODY, "device": -1}}),
    _packed({"v": 1, "id": 9, "op": "step", "body": {**STEP_BODY, "extra": 1}}),
    _packed({"v": 1, "id": 9, "op": "step", "body": STEP_BODY, "extra": 1}),
    _packed({"v": 1, "op": "step", "body": STEP_BODY}),  # no id
    _packed({"v": 1, "id": 9, "op": "step", "body": STEP_BODY}, b"unused frame"),
    _packed({"v": 1, "id": 9, "op": "step", "body": {
        **STEP_BODY, "inputs": {"q": {TENSOR_KEY: {"dtype": "int8", "shape": [3], "frame": 1}}},
    }}, b"xx"),  # a frame of the wrong size
    _packed({"v": 1, "id": 9, "op": "step", "body": {
        **STEP_BODY, "inputs": {
            "a": {TENSOR_KEY: {"dtype": "int8", "shape": [2], "frame": 1}},
            "b": {TENSOR_KEY: {"dtype": "int8", "shape": [2], "frame": 1}},
        },
    }}, b"xx"),  # a frame referenced twice: the fallback starts with fresh frames
    [b"\x93"],
    [wire.bundle([bytes(VALID[0][0]), msgpack.packb({"v": 1, "id": 3, "op": "x"}), b"\xc1"])],
]  # fmt: skip


@pytest.mark.parametrize("frames", INVALID)
def test_anything_else_reads_as_the_two_step_way_says(frames: list[Any]) -> None:
    same(frames)


keys = st.sampled_from(["v", "id", "op", "body", "program", "device", "params", "inputs"])
values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**64 - 1) | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=4),
    max_leaves=12,
)
envelopes = st.fixed_dictionaries(
    {},
    optional={
        "v": st.just(1) | values,
        "id": st.integers(0, 2**64 - 1) | values,
        "op": st.sampled_from(sorted(OPS)) | values,
        "body": st.fixed_dictionaries(
            {}, optional={k: st.just(v) | values for k, v in STEP_BODY.items()}
        )
        | values,
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(envelopes, min_size=1, max_size=3), st.booleans())
def test_envelope_like_maps_read_alike(items: list[dict[str, Any]], bundled: bool) -> None:
    packed = [msgpack.packb(item, use_bin_type=True) for item in items]
    same([wire.bundle(packed)] if bundled else packed[:1])


@settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(hostile.messages())
def test_hostile_messages_read_alike(frames: list[bytes]) -> None:
    """Nested deep, wide, wrong at any field, frames cut or added (tests/hostile.py):
    the one pass and the two steps give the same requests and errors."""
    same(frames)
