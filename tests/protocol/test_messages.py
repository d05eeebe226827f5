"""Typed request bodies: round trips through the codec, and every validation rule."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from graphlane.protocol import (
    MAX_OUTPUTS,
    MESSAGES,
    BadRequest,
    DrainRequest,
    ErrorCode,
    Hello,
    Message,
    ReplayRequestMsg,
    ShutdownRequest,
    StatusRequest,
    StepRequestMsg,
    UpdateRequestMsg,
    decode_request,
    encode_message,
    parse_body,
)

MISSING = object()
LENGTHS = {"actual_seq_lengths_kv": [17, 3, 40]}
QUERY = torch.randn(3, 4, 1, 64).half()

EXAMPLES: list[Message] = [
    Hello(),
    Hello(client="sched-0"),
    StatusRequest(),
    StepRequestMsg("attention", 0, 3, LENGTHS),
    StepRequestMsg(
        "attention",
        device=1,
        batch=3,
        params={**LENGTHS, "scale": 0.125, "mask": torch.ones(3, dtype=torch.bool)},
        inputs={"query": QUERY},
        outputs=("out", "lse"),
        timeout_ms=500,
    ),
    UpdateRequestMsg("attention", 0, 3, LENGTHS),
    UpdateRequestMsg("attention", 2, 3, LENGTHS, inputs={"query": QUERY}, timeout_ms=1),
    ReplayRequestMsg("attention", 0, 8),
    ReplayRequestMsg("attention", 0, 8, outputs=(), timeout_ms=20),
    DrainRequest(),
    DrainRequest(device=3),
    ShutdownRequest(),
]


def same(a: Any, b: Any) -> bool:
    """Equality that compares tensors by value, through dicts, lists and tuples."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: repr(m)[:40])
def test_round_trip_through_the_codec(message: Message) -> None:
    req = decode_request(encode_message(11, message))
    assert req.op == message.OP
    got = parse_body(req.op, req.body)
    assert type(got) is type(message)
    assert same(got.to_body(), message.to_body())
    assert same(type(message).from_body(message.to_body()).to_body(), message.to_body())


def test_ops_and_classes() -> None:
    assert set(MESSAGES) == {"hello", "status", "step", "update", "replay", "drain", "shutdown"}
    for op, cls in MESSAGES.items():
        assert op == cls.OP


def test_optional_fields_are_left_out_when_unset() -> None:
    assert DrainRequest().to_body() == {}
    assert StatusRequest().to_body() == {}
    body = StepRequestMsg("p", 0, 1, {}).to_body()
    assert body == {
        "program": "p",
        "device": 0,
        "batch": 1,
        "params": {},
        "inputs": {},
        "outputs": ["out"],
    }


def test_defaults_from_the_wire() -> None:
    msg = StepRequestMsg.from_body({"program": "p", "device": 0, "batch": 2, "params": {}})
    assert (msg.inputs, msg.outputs, msg.timeout_ms) == ({}, ("out",), None)
    assert Hello.from_body({}).client == ""
    assert DrainRequest.from_body({"device": None}).device is None
    assert (
        ReplayRequestMsg.from_body(
            {"program": "p", "device": 0, "batch": 1, "timeout_ms": None}
        ).timeout_ms
        is None
    )


@pytest.mark.parametrize("cls", [StepRequestMsg, UpdateRequestMsg])
def test_batch_is_inferred_from_the_sequence_lengths(cls: Any) -> None:
    msg = cls.from_body({"program": "p", "device": 0, "params": LENGTHS})
    assert msg.batch == 3
    explicit = cls.from_body({"program": "p", "device": 0, "batch": 8, "params": LENGTHS})
    assert explicit.batch == 8


def test_frozen() -> None:
    msg = StepRequestMsg("p", 0, 1, {})
    with pytest.raises(AttributeError):
        msg.batch = 2  # type: ignore[misc]


# --------------------------------------------------------------------------- validation


def refused(cls: Any, body: Any, field: str) -> None:
    with pytest.raises(BadRequest) as info:
        cls.from_body(body)
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert field in info.value.message, info.value.message


def edit(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v is not MISSING}


STEP = {"program": "attention", "device": 0, "batch": 3, "params": LENGTHS}
REPLAY = {"program": "attention", "device": 0, "batch": 3}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"program": MISSING}, "body.program"),
        ({"program": ""}, "body.program"),
        ({"program": 5}, "body.program"),
        ({"device": MISSING}, "body.device"),
        ({"device": -1}, "body.device"),
        ({"device": "0"}, "body.device"),
        ({"device": True}, "body.device"),
        ({"device": 0.0}, "body.device"),
        ({"batch": 0}, "body.batch"),
        ({"batch": "3"}, "body.batch"),
        ({"batch": MISSING, "params": {}}, "body.batch"),
        ({"batch": MISSING, "params": {"actual_seq_lengths_kv": 3}}, "body.batch"),
        ({"batch": MISSING, "params": {"actual_seq_lengths_kv": []}}, "body.batch"),
        ({"params": MISSING}, "body.params"),
        ({"params": [1]}, "body.params"),
        ({"inputs": {"query": [1.0]}}, "body.inputs.query"),
        ({"inputs": [QUERY]}, "body.inputs"),
        ({"inputs": None}, "body.inputs"),
        ({"outputs": "out"}, "body.outputs"),
        ({"outputs": ["out", 1]}, "body.outputs[1]"),
        ({"outputs": [""]}, "body.outputs[0]"),
        ({"outputs": ["out", "out"]}, "body.outputs"),
        ({"outputs": [f"o{i}" for i in range(MAX_OUTPUTS + 1)]}, "body.outputs"),
        ({"timeout_ms": 0}, "body.timeout_ms"),
        ({"timeout_ms": 1.5}, "body.timeout_ms"),
        ({"slot": 1}, "body.slot"),
    ],
)
def test_step_validation(changes: dict[str, Any], field: str) -> None:
    refused(StepRequestMsg, edit(STEP, changes), field)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"outputs": ["out"]}, "body.outputs"),
        ({"device": -2}, "body.device"),
        ({"inputs": {"q": 1}}, "body.inputs.q"),
        ({"params": MISSING}, "body.params"),
        ({"batch": MISSING, "params": {}}, "body.batch"),
    ],
)
def test_update_validation(changes: dict[str, Any], field: str) -> None:
    refused(UpdateRequestMsg, edit(STEP, changes), field)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"batch": MISSING}, "body.batch"),
        ({"params": LENGTHS}, "body.params"),
        ({"inputs": {}}, "body.inputs"),
        ({"outputs": [3]}, "body.outputs[0]"),
        ({"timeout_ms": -5}, "body.timeout_ms"),
        ({"program": None}, "body.program"),
    ],
)
def test_replay_validation(changes: dict[str, Any], field: str) -> None:
    refused(ReplayRequestMsg, edit(REPLAY, changes), field)


@pytest.mark.parametrize(
    ("cls", "body", "field"),
    [
        (Hello, {"client": 5}, "body.client"),
        (Hello, {"name": "x"}, "body.name"),
        (StatusRequest, {"verbose": True}, "body.verbose"),
        (DrainRequest, {"device": -1}, "body.device"),
        (DrainRequest, {"device": "all"}, "body.device"),
        (ShutdownRequest, {"now": True}, "body.now"),
        (ShutdownRequest, [], "body"),
    ],
)
def test_small_message_validation(cls: Any, body: Any, field: str) -> None:
    refused(cls, body, field)


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(BadRequest) as info:
        StepRequestMsg("p", device=-1, batch=1, params={})
    assert "body.device" in info.value.message
    with pytest.raises(BadRequest):
        ReplayRequestMsg("p", 0, 1, outputs=["a", "a"])  # type: ignore[arg-type]
    # A list of outputs is accepted and stored as a tuple.
    assert ReplayRequestMsg("p", 0, 1, outputs=["a"]).outputs == ("a",)  # type: ignore[arg-type]


def test_unknown_op() -> None:
    for op in ("stpe", "", 5):
        with pytest.raises(BadRequest) as info:
            parse_body(op, {})  # type: ignore[arg-type]
        assert info.value.code == ErrorCode.BAD_REQUEST and "op" in info.value.message


_STEP_VARIANTS: dict[str, list[Any]] = {
    "program": ["attention", "", 3, None, MISSING],
    "device": [0, 2, -1, True, 1.0, MISSING],
    "batch": [MISSING, 1, 3, 0, True, "3", None],
    "params": [
        LENGTHS,
        {},
        {"actual_seq_lengths_kv": []},
        {"actual_seq_lengths_kv": (1, 2)},
        {"actual_seq_lengths_kv": 7},
        {1: 2},
        [],
        None,
        MISSING,
    ],
    "outputs": [
        MISSING,
        [],
        ["out"],
        ("out", "lse"),
        ["out", "out"],
        ["out", ""],
        [["x"]],
        [{"a": 1}, {"a": 1}],
        ["o"] * (MAX_OUTPUTS + 1),
        "out",
        None,
    ],
    "inputs": [MISSING, {}, {"query": QUERY}, {"query": 1}, {1: QUERY}, [], None],
    "timeout_ms": [MISSING, None, 0, 5, True, 2.5],
    "extra": [MISSING, 1],
}


def _step_bodies() -> list[dict[str, Any]]:
    """A valid step body, and each field varied alone through valid and invalid values."""
    base = {"program": "attention", "device": 0, "params": LENGTHS}
    bodies = []
    for name, values in _STEP_VARIANTS.items():
        for value in values:
            body = {k: v for k, v in base.items() if k != name}
            if value is not MISSING:
                body[name] = value
            bodies.append(body)
    return bodies


@pytest.mark.parametrize("body", _step_bodies(), ids=repr)
def test_the_flat_step_check_agrees_with_the_full_one(
    body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """StepRequestMsg.from_body takes plain valid bodies through a flat check
    (_step_fields); whatever it is given, the outcome is the full path's."""
    from graphlane.protocol import messages

    def outcome() -> Any:
        try:
            return StepRequestMsg.from_body(dict(body))
        except BadRequest as exc:
            return str(exc)

    fast = outcome()
    monkeypatch.setattr(messages, "_step_fields", lambda body: None)
    full = outcome()
    if isinstance(full, str):
        assert fast == full
    else:
        assert isinstance(fast, StepRequestMsg)
        assert same(fast.to_body(), full.to_body()) and fast == full
