"""Each op's request and reply bodies, error replies, and the supervisor-worker pipe.

A body is decoded in the second step, with its op's type: every refusal is a
BAD_REQUEST carrying the request's id and naming the field (checked by the field's
path, never by message text).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import msgspec
import pytest
import torch

from graphlane.protocol import (
    DEFAULT_LIMITS,
    OPS,
    RETRYABLE,
    BadRequest,
    Busy,
    Codec,
    DecodeError,
    ErrorCode,
    Forbidden,
    GraphlaneError,
    InternalError,
    Limits,
    NoPreviousToken,
    PredecessorFailed,
    Reply,
    Request,
    RequestError,
    ServiceError,
    ShuttingDown,
    StateLost,
    Timeout,
    TooLarge,
    Unauthorized,
    UnknownDevice,
    UnknownProgram,
    UnsupportedVersion,
    WorkerLost,
    encode_error,
    encode_reply,
    encode_request,
    error_class,
    ops,
    pipe,
)
from graphlane.protocol.bounds import MAX_ITEMS, MAX_NAME
from graphlane.protocol.ops.steps import MAX_OUTPUTS, MAX_PARAMS


def decode_requests(frames: Any, limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    return Codec(limits).decode_requests(frames)


def decode_replies(frames: Any, limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    return Codec(limits).decode_replies(frames)


BAD = ErrorCode.BAD_REQUEST
MISSING = object()
LENGTHS = {"actual_seq_lengths_kv": [17, 3, 40]}
QUERY = torch.randn(3, 4, 1, 64).half()  # 1536 bytes: a frame

EXAMPLES: list[tuple[str, Any]] = [
    ("hello", ops.Hello()),
    ("hello", ops.Hello(client="sched-0")),
    ("status", ops.Status()),
    ("step", ops.Step("attention", 0, LENGTHS)),
    (
        "step",
        ops.Step(
            "attention",
            device=1,
            params={**LENGTHS, "scale": 0.125, "causal": True, "mode": "x", "none": None},
            inputs={"query": QUERY, "mask": torch.ones(3, dtype=torch.bool)},
            outputs=["out", "lse"],
            batch=3,
            timeout_ms=500,
        ),
    ),
    ("update", ops.Update("attention", 0, LENGTHS)),
    ("update", ops.Update("attention", 2, LENGTHS, {"query": QUERY}, batch=3, timeout_ms=1)),
    ("replay", ops.Replay("attention", 0, 8)),
    ("replay", ops.Replay("attention", 0, 8, outputs=["out"], timeout_ms=20)),
    ("step", ops.Step("paged_attention", 0, LENGTHS, generation=3)),
    (
        "kv_write",
        ops.KvWrite(
            "paged_attention",
            0,
            torch.arange(4),
            torch.ones(2, 4, 2, 16, dtype=torch.float16),
            torch.zeros(2, 4, 2, 16, dtype=torch.float16),
            generation=0,
            timeout_ms=100,
        ),
    ),
    ("kv_read", ops.KvRead("paged_attention", 1, torch.arange(3, dtype=torch.int32))),
    ("resume", ops.Resume(0)),
    (
        "prefill",
        ops.Prefill(
            "model",
            0,
            torch.arange(5, dtype=torch.int64),
            torch.arange(4, dtype=torch.int32),
            start=2,
            params={"temperature": 0.5, "seed": 7},
            outputs=["tokens"],
        ),
    ),
    (
        "add",
        ops.AddSequence(
            "model",
            0,
            7,
            torch.arange(5),
            [3, 4],
            params={"seed": 2},
            outputs=["tokens"],
            generation=1,
        ),
    ),
    ("decode", ops.Decode("model", 0, [7, 0], new_blocks={7: [5]}, timeout_ms=50)),
    ("append_blocks", ops.AppendBlocks("model", 0, 7, [6, 8], generation=1)),
    ("free", ops.Free("model", 0, [7])),
    ("drain", ops.Drain()),
    ("drain", ops.Drain(device=3)),
    ("shutdown", ops.Shutdown()),
]


def plain(value: Any) -> Any:
    """A body as comparable builtins (tensors as their dtype, shape and values)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.tolist())
    if isinstance(value, msgspec.Struct):
        return type(value), plain(msgspec.structs.asdict(value))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def request(op: str, body: Any, *frames: bytes) -> Request:
    """The request decoded; its DecodeError raised."""
    if not frames and not isinstance(body, dict):
        sent = encode_request(11, op, body)
    else:
        sent = [msgpack.packb({"v": 1, "id": 11, "op": op, "body": body}), *frames]
    (req,) = decode_requests(sent)
    if isinstance(req, DecodeError):
        raise req
    return req


def decoded(op: str, body: Any) -> Any:
    return request(op, body).body


def refused(op: str, body: Any, field: str) -> None:
    with pytest.raises(DecodeError) as info:
        decoded(op, body)
    err = info.value
    assert (err.code, err.request_id) == (BAD, 11), err
    assert field in err.message, err
    assert isinstance(err.to_error(), BadRequest)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(("op", "message"), EXAMPLES, ids=lambda m: repr(m)[:40])
def test_round_trip(op: str, message: Any) -> None:
    got = decoded(op, message)
    assert type(got) is OPS[op].request and plain(got) == plain(message)


def test_every_op_has_a_round_trip_example() -> None:
    """A new op's tensors come out as tensors only if its body takes them: each op is
    round-tripped above."""
    assert {op for op, _ in EXAMPLES} == set(OPS)


def test_ops_and_their_types() -> None:
    assert set(OPS) == {"hello", "status", "step", "update", "replay", "drain", "shutdown",
                        "kv_write", "kv_read", "prefill", "resume", "add", "decode",
                        "append_blocks", "free"}  # fmt: skip
    device_ops = {"step", "update", "replay", "kv_write", "kv_read", "prefill", "resume",
                  "add", "decode", "append_blocks", "free"}  # fmt: skip
    assert {name for name, op in OPS.items() if op.device} == device_ops
    answered_at_once = {"resume", "append_blocks", "free"}
    for name, op in OPS.items():
        assert op.name == name
        device_work = op.device and name not in answered_at_once
        assert op.reply is (ops.DeviceResult if device_work else ops.Info)


def test_unset_optional_fields_are_left_out_of_the_wire() -> None:
    def body(op: str, message: Any) -> Any:
        return msgpack.unpackb(encode_request(1, op, message)[0])["body"]

    assert body("drain", ops.Drain()) == {} and body("status", ops.Status()) == {}
    assert body("hello", ops.Hello()) == {}
    assert body("step", ops.Step("p", 0)) == {"program": "p", "device": 0}
    assert body("replay", ops.Replay("p", 0, 2)) == {"program": "p", "device": 0, "batch": 2}


def test_defaults_from_the_wire() -> None:
    step = decoded("step", {"program": "p", "device": 0})
    assert (step.params, step.inputs, step.outputs, step.batch, step.timeout_ms) == (
        {},
        {},
        [],
        None,
        None,
    )
    assert decoded("hello", {}).client == ""
    assert decoded("drain", {"device": None}).device is None
    replay = {"program": "p", "device": 0, "batch": 1, "timeout_ms": None}
    assert decoded("replay", replay).timeout_ms is None


def test_bodies_are_frozen() -> None:
    with pytest.raises(AttributeError):
        ops.Step("p", 0).batch = 2  # type: ignore[misc]


def test_a_body_built_wrong_is_refused_by_its_receiver() -> None:
    """Structs are not validated when built: the decoder is the one gate."""
    refused("step", ops.Step("p", device=-1), "body.device")
    refused("replay", ops.Replay("p", 0, 0), "body.batch")


def test_an_unknown_op_is_refused_with_its_id() -> None:
    for op in ("stpe", "STEP", "x" * MAX_NAME):
        with pytest.raises(DecodeError) as info:
            request(op, {"program": "p"})
        assert (info.value.code, info.value.request_id) == (BAD, 11)
        assert op in info.value.message  # names the op it does not know


# ---------------------------------------------------------------------------- validation


def edit(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v is not MISSING}


STEP = {"program": "attention", "device": 0, "batch": 3, "params": LENGTHS}
REPLAY = {"program": "attention", "device": 0, "batch": 3}
LONG = "x" * (MAX_NAME + 1)
TENSOR = {"$tensor": {"dtype": "int8", "shape": [1], "data": b"\0"}}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"program": MISSING}, "body.program"),
        ({"program": ""}, "body.program"),
        ({"program": 5}, "body.program"),
        ({"program": LONG}, "body.program"),
        ({"device": MISSING}, "body.device"),
        ({"device": -1}, "body.device"),
        ({"device": "0"}, "body.device"),
        ({"device": True}, "body.device"),
        ({"device": 0.0}, "body.device"),
        ({"batch": 0}, "body.batch"),
        ({"batch": "3"}, "body.batch"),
        ({"batch": True}, "body.batch"),
        ({"params": [1]}, "body.params"),
        ({"params": {"x": {"a": 1}}}, "body.params[...]"),
        ({"params": {"x": [[1]]}}, "body.params[...][0]"),
        ({"params": {"x": ["1"]}}, "body.params[...][0]"),
        ({"params": {"x": TENSOR}}, "body.params[...]"),
        ({"params": {"x": msgpack.ExtType(5, b"xx")}}, "body.params[...]"),
        ({"params": {"x": list(range(MAX_ITEMS + 1))}}, "body.params[...]"),
        ({"params": {f"p{i}": i for i in range(MAX_PARAMS + 1)}}, "body.params"),
        ({"params": {LONG: 1}}, "body.params (a key)"),
        ({"params": {"": 1}}, "body.params (a key)"),
        ({"params": {b"k": 1}}, "body.params (a key)"),
        ({"inputs": {"query": [1.0]}}, "body.inputs[...]"),
        ({"inputs": {"query": 1}}, "body.inputs[...]"),
        ({"inputs": [TENSOR]}, "body.inputs"),
        ({"inputs": None}, "body.inputs"),
        ({"inputs": {LONG: TENSOR}}, "body.inputs (a key)"),
        ({"inputs": {f"t{i}": TENSOR for i in range(MAX_PARAMS + 1)}}, "body.inputs"),
        ({"outputs": "out"}, "body.outputs"),
        ({"outputs": ["out", 1]}, "body.outputs[1]"),
        ({"outputs": [""]}, "body.outputs[0]"),
        ({"outputs": [LONG]}, "body.outputs[0]"),
        ({"outputs": [f"o{i}" for i in range(MAX_OUTPUTS + 1)]}, "body.outputs"),
        ({"timeout_ms": 0}, "body.timeout_ms"),
        ({"timeout_ms": 1.5}, "body.timeout_ms"),
        ({"timeout_ms": True}, "body.timeout_ms"),
        ({"slot": 1}, "body.slot"),
    ],
)
def test_step_validation(changes: dict[str, Any], field: str) -> None:
    refused("step", edit(STEP, changes), field)


def test_step_bounds_are_inclusive() -> None:
    body = edit(
        STEP,
        {
            "program": "x" * MAX_NAME,
            "params": {f"p{i}": list(range(MAX_ITEMS)) for i in range(MAX_PARAMS)},
            "outputs": [f"o{i}" for i in range(MAX_OUTPUTS)],
        },
    )
    step = decoded("step", body)
    assert len(step.params) == MAX_PARAMS and len(step.outputs) == MAX_OUTPUTS


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"outputs": ["out"]}, "body.outputs"),
        ({"device": -2}, "body.device"),
        ({"inputs": {"q": 1}}, "body.inputs[...]"),
        ({"batch": 0}, "body.batch"),
        ({"program": MISSING}, "body.program"),
    ],
)
def test_update_validation(changes: dict[str, Any], field: str) -> None:
    refused("update", edit(STEP, changes), field)


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
    refused("replay", edit(REPLAY, changes), field)


@pytest.mark.parametrize(
    ("op", "body", "field"),
    [
        ("hello", {"client": 5}, "body.client"),
        ("hello", {"client": LONG}, "body.client"),
        ("hello", {"name": "x"}, "body.name"),
        ("status", {"verbose": True}, "body.verbose"),
        ("drain", {"device": -1}, "body.device"),
        ("drain", {"device": "all"}, "body.device"),
        ("shutdown", {"now": True}, "body.now"),
        ("shutdown", [], "body"),
        ("status", None, "body"),
    ],
)
def test_control_validation(op: str, body: Any, field: str) -> None:
    refused(op, body, field)


# -------------------------------------------------------------------------------- replies


def reply_of(frames: list[Any]) -> Reply:
    (reply,) = decode_replies(frames)
    assert isinstance(reply, Reply), reply
    return reply


def test_step_done_round_trip() -> None:
    out, lse = torch.randn(8, 32, 1, 128).half(), torch.zeros(8)
    frames = encode_reply(9, ops.DeviceResult({"out": out, "lse": lse}, 8, 2, 4, 812.5))
    assert len(frames) == 2  # out as a frame, lse inline
    reply = reply_of(frames)
    done = reply.body(OPS["step"])
    assert (reply.id, reply.error) == (9, None)
    assert torch.equal(done.outputs["out"], out) and torch.equal(done.outputs["lse"], lse)
    assert (done.bucket, done.instance, done.patched, done.server_us) == (8, 2, 4, 812.5)


def test_step_done_defaults_and_fields_a_newer_server_adds() -> None:
    done = reply_of(encode_reply(1, ops.DeviceResult())).body(OPS["update"])
    assert (done.outputs, done.bucket, done.instance, done.patched) == ({}, 0, 0, 0)
    newer = {"v": 1, "id": 1, "ok": True, "body": {"instance": 1, "queue_us": 3.5}}
    assert reply_of([msgpack.packb(newer)]).body(OPS["step"]).instance == 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"instance": -1}, "body.instance"),
        ({"bucket": "8"}, "body.bucket"),
        ({"outputs": {"out": [1.0]}}, "body.outputs[...]"),
        ({"outputs": {"out": {"$tensor": {"dtype": "int8", "shape": [1], "frame": 1}}}}, "$tensor"),
    ],
)
def test_step_done_validation(body: dict[str, Any], field: str) -> None:
    reply = reply_of([msgpack.packb({"v": 1, "id": 4, "ok": True, "body": body})])
    with pytest.raises(DecodeError) as info:
        reply.body(OPS["step"])
    assert (info.value.code, info.value.request_id) == (BAD, 4) and field in info.value.message


def test_control_replies_are_maps() -> None:
    info = {"version": 1, "workers": [{"device": 0, "state": "ready"}], "new": True}
    assert reply_of(encode_reply(2, info)).body(OPS["hello"]) == info


def reply_env(**fields: Any) -> dict[str, Any]:
    env: dict[str, Any] = {"v": 1, "id": 42, "ok": True, "body": {}}
    env.update(fields)
    return {k: v for k, v in env.items() if v is not MISSING}


BUSY = {"code": "BUSY", "message": "", "retryable": True}


@pytest.mark.parametrize(
    ("env", "field"),
    [
        (reply_env(ok=MISSING), "envelope.ok"),
        (reply_env(ok=1), "envelope.ok"),
        (reply_env(error=BUSY), "ok"),  # ok and error disagree
        (reply_env(ok=False, body=MISSING), "ok"),
        (reply_env(ok=False, body=MISSING, error="BUSY"), "envelope.error"),
        (reply_env(ok=False, body=MISSING, error={"code": "BUSY"}), "envelope.error.message"),
        (reply_env(ok=False, error={**BUSY, "x": 1}), "envelope.error.x"),
        (reply_env(extra=0), "envelope.extra"),
        (reply_env(v=3), "version"),
    ],
)
def test_reply_envelope_rules(env: dict[str, Any], field: str) -> None:
    (err,) = decode_replies([msgpack.packb(env)])
    assert isinstance(err, DecodeError) and (err.code, err.request_id) == (BAD, 42), err
    assert field in err.message, err


def test_a_reply_without_a_readable_id_cannot_be_matched() -> None:
    (err,) = decode_replies([msgpack.packb(reply_env(id="x"))])
    assert isinstance(err, DecodeError) and err.request_id is None


def test_an_error_reply_carries_no_data_frames() -> None:
    (err,) = decode_replies([*encode_error(42, Busy("full")), b"x"])
    assert isinstance(err, DecodeError) and (err.code, err.request_id) == (BAD, 42)


def test_a_reply_body_that_is_no_map() -> None:
    reply = reply_of([msgpack.packb(reply_env(body=[]))])
    with pytest.raises(DecodeError) as info:
        reply.body(OPS["step"])
    assert info.value.request_id == 42 and "body" in info.value.message


# --------------------------------------------------------------------------------- errors

CLASSES: dict[ErrorCode, type[GraphlaneError]] = {
    ErrorCode.BAD_REQUEST: BadRequest,
    ErrorCode.UNKNOWN_PROGRAM: UnknownProgram,
    ErrorCode.UNKNOWN_DEVICE: UnknownDevice,
    ErrorCode.BUSY: Busy,
    ErrorCode.WORKER_LOST: WorkerLost,
    ErrorCode.TIMEOUT: Timeout,
    ErrorCode.UNSUPPORTED_VERSION: UnsupportedVersion,
    ErrorCode.UNAUTHORIZED: Unauthorized,
    ErrorCode.FORBIDDEN: Forbidden,
    ErrorCode.SHUTTING_DOWN: ShuttingDown,
    ErrorCode.INTERNAL: InternalError,
    ErrorCode.STATE_LOST: StateLost,
    ErrorCode.PREDECESSOR_FAILED: PredecessorFailed,
    ErrorCode.TOO_LARGE: TooLarge,
    ErrorCode.NO_PREVIOUS_TOKEN: NoPreviousToken,
}


def test_every_code_has_its_class_and_family() -> None:
    assert set(CLASSES) == set(ErrorCode)
    retryable = {ErrorCode.BUSY, ErrorCode.WORKER_LOST, ErrorCode.TIMEOUT, ErrorCode.SHUTTING_DOWN,
                 ErrorCode.PREDECESSOR_FAILED}  # fmt: skip
    assert set(RETRYABLE) == retryable
    for code, cls in CLASSES.items():
        assert error_class(code) is cls and error_class(str(code)) is cls and cls.code == code
        family = ServiceError if code in RETRYABLE or code == ErrorCode.INTERNAL else RequestError
        assert issubclass(cls, family)
    assert error_class("NO_SUCH_CODE") is InternalError


@pytest.mark.parametrize("code", list(ErrorCode))
@pytest.mark.parametrize("override", [None, True, False])
def test_error_replies_round_trip_and_body_raises_them(
    code: ErrorCode, override: bool | None
) -> None:
    sent = CLASSES[code]("what happened", retryable=override)
    assert sent.retryable == (code in RETRYABLE if override is None else override)
    frames = encode_error(77, sent)
    assert len(frames) == 1
    reply = reply_of(frames)
    got = reply.error
    assert reply.id == 77 and type(got) is CLASSES[code]
    assert (got.code, got.message, got.retryable) == (code, "what happened", sent.retryable)
    for op in OPS.values():
        with pytest.raises(CLASSES[code]):
            reply.body(op)


def test_an_unknown_wire_code_keeps_the_message_and_retryable() -> None:
    wire = {"code": "QUOTA", "message": "over quota", "retryable": True}
    reply = reply_of([msgpack.packb(reply_env(ok=False, body=MISSING, error=wire))])
    assert isinstance(reply.error, InternalError) and reply.error.retryable
    assert "QUOTA" in reply.error.message and "over quota" in reply.error.message


@pytest.mark.parametrize(
    "wire",
    [
        "BUSY",
        {"code": "BUSY", "message": "m"},
        {"code": 1, "message": "m", "retryable": True},
        {"code": "BUSY", "message": b"m", "retryable": True},
        {"code": "BUSY", "message": "m", "retryable": 1},
        {"code": "BUSY", "message": "m", "retryable": True, "extra": 1},
    ],
)
def test_a_malformed_wire_error_is_an_undecodable_reply_with_its_id(wire: Any) -> None:
    (err,) = decode_replies([msgpack.packb(reply_env(ok=False, body=MISSING, error=wire))])
    assert isinstance(err, DecodeError) and err.request_id == reply_env()["id"], err
    assert "envelope.error" in err.message


# ----------------------------------------------------------------------------------- pipe


@pytest.fixture
def conns() -> Iterator[tuple[Connection, Connection]]:
    a, b = multiprocessing.Pipe()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    "message",
    [
        pipe.Ready({"device": 0, "programs": ["attention"], "endpoint": "ipc:///tmp/x"}),
        pipe.Failed("no device"),
        pipe.Pong({"state": "ready", "steps": 3, "queued": 0}),
        pipe.Ping(),
        pipe.Finish(),
        pipe.Finish(stop=True),
    ],
    ids=repr,
)
def test_pipe_messages_round_trip(conns: tuple[Connection, Connection], message: Any) -> None:
    a, b = conns
    pipe.send(a, message)
    assert b.poll(10)
    got = pipe.recv(b)
    assert type(got) is type(message) and got == message


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",
        msgpack.packb({"info": {}}),
        msgpack.packb({"type": "hello"}),
        msgpack.packb({"type": "drain", "stop": "yes"}),
        msgpack.packb({"type": "ready"}),
        msgpack.packb(["ping"]),
    ],
    ids=repr,
)
def test_an_unreadable_pipe_message_is_a_value_error(
    conns: tuple[Connection, Connection], data: bytes
) -> None:
    a, b = conns
    a.send_bytes(data)
    assert b.poll(10)
    with pytest.raises(ValueError):
        pipe.recv(b)


def test_a_closed_pipe_is_end_of_file(conns: tuple[Connection, Connection]) -> None:
    a, b = conns
    a.close()
    with pytest.raises(EOFError):
        pipe.recv(b)
