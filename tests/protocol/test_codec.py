"""The codec: round trips, zero copy, every decoding rule, and the error tree on the wire."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq

from graphlane.protocol import (
    DEFAULT_LIMITS,
    DTYPES,
    INLINE_TENSOR_BYTES,
    RETRYABLE,
    TENSOR_KEY,
    BadRequest,
    Busy,
    DecodeError,
    ErrorCode,
    GraphlaneError,
    InternalError,
    Limits,
    Reply,
    Request,
    RequestError,
    ServiceError,
    ShuttingDown,
    Timeout,
    Unauthorized,
    UnknownDevice,
    UnknownProgram,
    UnsupportedVersion,
    WorkerLost,
    bundle,
    bundles,
    decode_replies,
    decode_reply,
    decode_request,
    decode_requests,
    encode_error,
    encode_outputs_reply,
    encode_reply,
    encode_request,
    error_class,
    error_from_wire,
    tensor_to_wire,
)

BAD = ErrorCode.BAD_REQUEST
MISSING = object()


# ------------------------------------------------------------------------------ helpers


def sample(dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Deterministic non-trivial values of any dtype (no NaN, so torch.equal works)."""
    gen = torch.Generator().manual_seed(math.prod(shape) + len(shape))
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(tuple(shape), generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(low, high, tuple(shape), generator=gen, dtype=dtype)


def address(buf: Any) -> int:
    """Address of the first byte of a buffer (bytes, bytearray, memoryview)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def envelope(**fields: Any) -> dict[str, Any]:
    env: dict[str, Any] = {"v": 1, "id": 42, "op": "step", "body": {}}
    env.update(fields)
    return {k: v for k, v in env.items() if v is not MISSING}


def packed(env: Any, *frames: bytes | bytearray) -> list[bytes | bytearray]:
    return [msgpack.packb(env, use_bin_type=True), *frames]


def tspec(dtype: Any = "float32", shape: Any = (2,), **fields: Any) -> dict[str, Any]:
    spec = {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape}
    spec.update(fields)
    return {TENSOR_KEY: {k: v for k, v in spec.items() if v is not MISSING}}


def rejected(
    frames: Sequence[Any],
    code: ErrorCode,
    request_id: int | None,
    fragment: str = "",
    *,
    limits: Limits = DEFAULT_LIMITS,
    reply: bool = False,
) -> DecodeError:
    decode = decode_reply if reply else decode_request
    with pytest.raises(DecodeError) as info:
        decode(frames, limits)
    err = info.value
    assert err.code == code, err
    assert err.request_id == request_id, err
    assert fragment in err.message, err
    return err


# --------------------------------------------------------------------------- round trips

SHAPES = [(), (0,), (3, 5), (2, 0, 3), (40, 40)]


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensor_round_trip(dtype_name: str, shape: tuple[int, ...]) -> None:
    dtype = DTYPES[dtype_name]
    t = sample(dtype, shape)
    frames = encode_request(1, "step", {"inputs": {"x": t}})
    large = t.numel() * t.element_size() > INLINE_TENSOR_BYTES
    assert len(frames) == (2 if large else 1)
    wire = msgpack.unpackb(frames[0])["body"]["inputs"]["x"][TENSOR_KEY]
    assert wire["dtype"] == dtype_name and wire["shape"] == list(shape)
    assert ("frame" in wire) == large and ("data" in wire) == (not large)

    got = decode_request(frames).body["inputs"]["x"]
    assert got.dtype == dtype and tuple(got.shape) == shape
    assert torch.equal(got, t)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_non_contiguous_tensors_round_trip(dtype_name: str) -> None:
    base = sample(DTYPES[dtype_name], (64, 48))
    views = {"t": base.t(), "step": base[::2, 1::3], "small": base[:4, :4].t()}
    assert not any(v.is_contiguous() for v in views.values())
    frames = encode_request(1, "step", views)
    body = decode_request(frames).body
    for name, view in views.items():
        assert torch.equal(body[name], view), name


def test_nested_body_round_trip() -> None:
    small, large = torch.arange(6, dtype=torch.int32), torch.randn(32, 32)
    body = {
        "none": None,
        "flags": [True, False],
        "ints": [0, -1, -(2**63), 2**64 - 1],
        "float": 1.5,
        "text": "héllo",
        "raw": b"\x00\xff",
        "tuple": (1, "two", (3.0,)),
        "deep": {"a": {"b": [{"c": [small, large]}]}},
        "empty": {},
    }
    frames = encode_request(2**64 - 1, "custom", body)
    req = decode_request(frames)
    assert (req.id, req.op) == (2**64 - 1, "custom")
    got = req.body
    assert got["tuple"] == [1, "two", [3.0]]
    inner = got["deep"]["a"]["b"][0]["c"]
    assert torch.equal(inner[0], small) and torch.equal(inner[1], large)
    for key in ("none", "flags", "ints", "float", "text", "raw", "empty"):
        assert got[key] == body[key], key


def test_reply_round_trip() -> None:
    out = torch.randn(8, 32, 1, 128).half()
    frames = encode_reply(9, {"outputs": {"out": out, "lse": torch.zeros(8)}, "bucket": 8})
    reply = decode_reply(frames)
    assert (reply.id, reply.ok, reply.error) == (9, True, None)
    assert torch.equal(reply.unwrap()["outputs"]["out"], out)
    assert reply.body["bucket"] == 8


def test_empty_body_and_bytearray_memoryview_values() -> None:
    assert decode_request(encode_request(0, "status", {})).body == {}
    frames = encode_request(1, "x", {"a": bytearray(b"ab"), "b": memoryview(b"cd")})
    assert decode_request(frames).body == {"a": b"ab", "b": b"cd"}


def test_zmq_frames_decode_without_copy() -> None:
    t = torch.randn(64, 64)
    frames = [zmq.Frame(bytes(f)) for f in encode_request(3, "step", {"x": t})]
    got = decode_request(frames).body["x"]
    assert torch.equal(got, t)
    assert got.data_ptr() == address(frames[1].buffer)


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://codec")
        b.connect("inproc://codec")
        yield a, b
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.destroy(linger=0)


def test_over_a_real_socket(pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    a, b = pair
    t = torch.randn(128, 64).to(torch.bfloat16)
    a.send_multipart(encode_request(5, "step", {"inputs": {"q": t}}), copy=False)
    req = decode_request(b.recv_multipart(copy=False))
    assert torch.equal(req.body["inputs"]["q"], t)
    b.send_multipart(encode_error(req.id, Busy("queue full")))
    reply = decode_reply(a.recv_multipart(copy=False))
    assert isinstance(reply.error, Busy) and reply.id == 5


# ------------------------------------------------------------------------------ zero copy


def test_large_contiguous_tensor_is_sent_without_copy() -> None:
    t = torch.randn(64, 64)
    frames = encode_request(1, "step", {"x": t})
    frame = frames[1]
    assert isinstance(frame, memoryview) and frame.nbytes == t.numel() * 4
    assert address(frame) == t.data_ptr()
    t[0, 0] = 1234.5  # the frame is the tensor's memory
    assert np.frombuffer(frame, dtype=np.float32)[0] == 1234.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.bool, torch.int64])
def test_zero_copy_for_every_itemsize_and_offset(dtype: torch.dtype) -> None:
    base = sample(dtype, (3000,))
    t = base[1000:]  # contiguous, with a storage offset
    frames = encode_request(1, "step", {"x": t})
    assert address(frames[1]) == t.data_ptr()


def test_non_contiguous_tensor_is_copied_once() -> None:
    t = torch.randn(64, 64).t()
    frames = encode_request(1, "step", {"x": t})
    assert address(frames[1]) != t.data_ptr()
    assert bytes(frames[1]) == t.contiguous().numpy().tobytes()


def test_decoded_tensor_views_the_received_buffer() -> None:
    t = torch.arange(1024, dtype=torch.float32)
    received = bytearray(t.numpy().tobytes())
    got = decode_request([encode_request(1, "step", {"x": t})[0], received]).body["x"]
    assert got.data_ptr() == address(received)
    received[0:4] = np.float32(-7.0).tobytes()
    assert got[0].item() == -7.0


def test_tensor_to_wire_appends_frames_and_numbers_them_from_one() -> None:
    frames: list[bytes | memoryview] = [b"already"]
    spec = tensor_to_wire(torch.zeros(1000), frames)
    assert spec == {TENSOR_KEY: {"dtype": "float32", "shape": [1000], "frame": 2}}
    assert len(frames) == 2


def test_bodies_msgpack_takes_as_they_are_encode_as_the_walk_converts_them() -> None:
    """The fast check (_as_is) and the converting walk (_to_wire) agree: a plain body
    is packed as it is, and anything else (tuples, int subclasses, byte buffers,
    non-dict mappings, tensors) is converted first; both decode to the same body."""
    import enum
    import types

    from graphlane.protocol import codec as codec_mod

    class Level(enum.IntEnum):
        HIGH = 3

    plain = {"a": [1, -(2**63), 2**64 - 1, 1.5, None, True, "s", b"b"], "m": {"k": (1, [2])}}
    assert codec_mod._as_is(plain, 1)
    walked = codec_mod._to_wire(plain, "body", [], 1)
    assert encode_request(1, "step", plain)[0] == msgpack.packb(
        {"v": 1, "id": 1, "op": "step", "body": walked}, use_bin_type=True
    )
    converted = {
        "level": Level.HIGH,
        "buf": bytearray(b"xy"),
        "view": types.MappingProxyType({"k": memoryview(b"z")}),
        "t": torch.arange(3, dtype=torch.int32),
    }
    assert not codec_mod._as_is(converted, 1)
    body = decode_request(encode_request(2, "step", converted)).body
    assert body["level"] == 3 and type(body["level"]) is int
    assert body["buf"] == b"xy" and body["view"] == {"k": b"z"}
    assert body["t"].tolist() == [0, 1, 2]


# ----------------------------------------------------------------------- encoding errors


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"params": {"x": {1, 2}}}, "body.params.x"),
        ({"params": [0, object()]}, "body.params[1]"),
        ({"a": np.zeros(3)}, "body.a"),
        ({"a": {1: "x"}}, "body.a"),
        ({"a": {TENSOR_KEY: 1}}, "body.a"),
        ({"a": 2**64}, "body.a"),
        ({"a": -(2**63) - 1}, "body.a"),
        ({"a": torch.zeros(2, dtype=torch.complex64)}, "body.a"),
        ({"a": torch.zeros(2, device="meta")}, "body.a"),
        ({"a": torch.zeros(3, 3).to_sparse()}, "body.a"),
    ],
)
def test_unsendable_values_name_their_path(body: dict[str, Any], path: str) -> None:
    with pytest.raises(ValueError, match=path.replace("[", r"\[").replace("]", r"\]")):
        encode_request(1, "step", body)


def test_cycles_and_bad_envelope_arguments_are_refused() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="cycle"):
        encode_request(1, "step", {"c": cycle})
    for bad_id in (-1, 2**64, True, 1.0):
        with pytest.raises(ValueError, match="request id"):
            encode_request(bad_id, "step", {})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="op"):
        encode_request(1, "", {})
    with pytest.raises(ValueError, match="body"):
        encode_reply(1, [1, 2])  # type: ignore[arg-type]


# ---------------------------------------------------------------- decoding: size and envelope


def test_garbage_has_no_request_id() -> None:
    rejected([b"\xc1\xff garbage"], BAD, None, "envelope")


def test_no_frames() -> None:
    rejected([], BAD, None, "no frames")


def test_frames_that_are_not_buffers() -> None:
    rejected([b"\x80", 5], BAD, None, "frame 1")
    rejected(b"\x80", BAD, None, "sequence")  # one buffer instead of a list of frames


def test_an_unexpected_failure_becomes_bad_request() -> None:
    class Exploding(Sequence[bytes]):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, index: Any) -> Any:
            raise RuntimeError("boom")

    rejected(Exploding(), BAD, None, "boom")


def test_too_many_frames_keeps_the_id() -> None:
    limits = Limits(max_frames=3)
    rejected(packed(envelope(), b"a", b"b", b"c"), BAD, 42, "frames", limits=limits)


def test_message_over_the_size_limit_keeps_the_id() -> None:
    limits = Limits(max_message_bytes=100)
    rejected(packed(envelope(), bytes(200)), BAD, 42, "bytes", limits=limits)


def test_envelope_over_its_limit_names_its_id_unless_far_over() -> None:
    """Just over the limit, the id is still read so the sender hears why; more than
    four times over, the envelope is not read at all."""
    frames = packed(envelope(body={"s": "x" * 200}))
    rejected(frames, BAD, 42, "envelope", limits=Limits(max_envelope_bytes=100))
    frames = packed(envelope(body={"s": "x" * 500}))
    rejected(frames, BAD, None, "envelope", limits=Limits(max_envelope_bytes=100))


@pytest.mark.parametrize(
    ("body", "limits"),
    [
        ({"l": list(range(10))}, Limits(max_items=5)),
        ({str(i): i for i in range(10)}, Limits(max_items=5)),
        ({"s": "x" * 100}, Limits(max_str_bytes=50)),
    ],
    ids=["list", "map", "str"],
)
def test_msgpack_bounds_keep_the_id(body: dict[str, Any], limits: Limits) -> None:
    rejected(packed(envelope(body=body)), BAD, 42, "limit", limits=limits)


def test_envelope_must_be_a_map() -> None:
    rejected(packed([1, 42, "step", {}]), BAD, None, "map")


@pytest.mark.parametrize("bad_id", [MISSING, -1, True, "42", 1.0, None])
def test_id_must_be_uint64(bad_id: Any) -> None:
    rejected(packed(envelope(id=bad_id)), BAD, None, "id")


def test_version_missing_is_a_bad_request() -> None:
    rejected(packed(envelope(v=MISSING)), BAD, 42, "v")


@pytest.mark.parametrize("version", [0, 2, "1", True, 1.0, None])
def test_other_versions_are_unsupported(version: Any) -> None:
    rejected(packed(envelope(v=version)), ErrorCode.UNSUPPORTED_VERSION, 42, "v")


def test_version_is_checked_before_everything_after_the_id() -> None:
    frames = packed({"id": 7, "v": 2, "op": 5, "junk": 1})
    rejected(frames, ErrorCode.UNSUPPORTED_VERSION, 7)


@pytest.mark.parametrize("op", [MISSING, 5, "", None])
def test_op_must_be_a_non_empty_str(op: Any) -> None:
    rejected(packed(envelope(op=op)), BAD, 42, "op")


@pytest.mark.parametrize("body", [MISSING, [], "x", None])
def test_body_must_be_a_map(body: Any) -> None:
    rejected(packed(envelope(body=body)), BAD, 42, "body")


def test_unknown_envelope_key() -> None:
    rejected(packed(envelope(extra=1)), BAD, 42, "extra")


# ------------------------------------------------------------------------ decoding: body


def test_body_depth_limit() -> None:
    deep: Any = 1
    for _ in range(8):
        deep = {"d": deep}
    decode_request(packed(envelope(body={"x": deep["d"]})))  # body + 7 levels: at the limit
    rejected(packed(envelope(body={"x": deep})), BAD, 42, "body.x.d.d.d.d.d.d.d")


def test_depth_counts_lists_too() -> None:
    deep: Any = [[[[[[[[1]]]]]]]]
    rejected(packed(envelope(body={"x": deep})), BAD, 42, "body.x[0]")


def test_body_keys_must_be_str() -> None:
    rejected(packed(envelope(body={"p": {b"k": 1}})), BAD, 42, "body.p")


def test_ext_values_are_refused() -> None:
    body = {"p": {"x": msgpack.ExtType(5, b"xx")}}
    rejected(packed(envelope(body=body)), BAD, 42, "body.p.x")


def test_body_cannot_be_a_tensor() -> None:
    body = tspec(data=bytes(8))
    rejected(packed(envelope(body=body)), BAD, 42, "body")


# ---------------------------------------------------------------------- decoding: tensors


def bad_tensor(
    spec: dict[str, Any], *frames: bytes, fragment: str, limits: Limits = DEFAULT_LIMITS
) -> None:
    body = {"inputs": {"query": spec}}
    rejected(packed(envelope(body=body), *frames), BAD, 42, fragment, limits=limits)


@pytest.mark.parametrize("dtype", ["complex64", "uint16", 5, None, MISSING, ["float32"], {"a": 1}])
def test_tensor_dtype_must_be_known(dtype: Any) -> None:
    bad_tensor(tspec(dtype=dtype, data=bytes(8)), fragment="body.inputs.query.dtype")


@pytest.mark.parametrize(
    "shape", [MISSING, "2", [2, -1], [2, True], [2.0], [1] * 9, {"a": 1}, [[2]], None]
)
def test_tensor_shape_must_be_small_list_of_naturals(shape: Any) -> None:
    bad_tensor(tspec(shape=shape, data=bytes(8)), fragment="body.inputs.query.shape")


def test_tensor_over_the_byte_limit() -> None:
    spec = tspec(shape=(1024,), frame=1)
    limits = Limits(max_tensor_bytes=1000)
    bad_tensor(spec, bytes(4096), fragment="body.inputs.query.shape", limits=limits)


def test_huge_shape_is_refused_before_looking_for_bytes() -> None:
    bad_tensor(tspec(shape=(2**40, 2**40), frame=1), bytes(8), fragment="body.inputs.query.shape")


@pytest.mark.parametrize("index", [0, 2, -1, True, "1", None])
def test_tensor_frame_index_must_exist(index: Any) -> None:
    bad_tensor(tspec(frame=index), bytes(8), fragment="body.inputs.query.frame")


def test_tensor_frame_length_must_match_shape() -> None:
    bad_tensor(tspec(frame=1), bytes(12), fragment="body.inputs.query.frame")


def test_tensor_inline_length_must_match_shape() -> None:
    bad_tensor(tspec(data=bytes(7)), fragment="body.inputs.query.data")


def test_tensor_inline_data_must_be_bin() -> None:
    bad_tensor(tspec(data="12345678"), fragment="body.inputs.query.data")


@pytest.mark.parametrize("both", [True, False])
def test_tensor_needs_exactly_one_of_frame_and_data(both: bool) -> None:
    spec = tspec(frame=1, data=bytes(8)) if both else tspec()
    bad_tensor(spec, *([bytes(8)] if both else []), fragment="body.inputs.query")


def test_tensor_unknown_field() -> None:
    bad_tensor(tspec(data=bytes(8), strides=[1]), fragment="body.inputs.query.strides")


def test_tensor_wrapper_has_one_key() -> None:
    spec = tspec(data=bytes(8))
    spec["other"] = 1
    bad_tensor(spec, fragment="body.inputs.query")


def test_tensor_spec_must_be_a_map() -> None:
    bad_tensor({TENSOR_KEY: [1]}, fragment="body.inputs.query")


def test_bool_tensor_bytes_must_be_0_or_1() -> None:
    bad_tensor(tspec(dtype="bool", shape=(2,), data=b"\x01\x02"), fragment="body.inputs.query")


def test_frame_referenced_twice() -> None:
    body = {"a": tspec(shape=(300,), frame=1), "b": tspec(shape=(300,), frame=1)}
    rejected(packed(envelope(body=body), bytes(1200)), BAD, 42, "body.b.frame")


def test_unreferenced_frames_are_refused() -> None:
    body = {"a": tspec(shape=(300,), frame=1)}
    rejected(packed(envelope(body=body), bytes(1200), b"extra"), BAD, 42, "extra frames")


def test_misaligned_frames_are_copied_to_an_aligned_tensor() -> None:
    t = torch.arange(300, dtype=torch.float64)
    buf = bytearray(1 + 300 * 8)
    buf[1:] = t.numpy().tobytes()
    frames = [
        msgpack.packb(envelope(body={"x": tspec("float64", (300,), frame=1)})),
        memoryview(buf)[1:],
    ]
    got = decode_request(frames).body["x"]
    assert got.data_ptr() % 8 == 0 and torch.equal(got, t)


# ------------------------------------------------------------------------ decoding: replies


def reply_env(**fields: Any) -> dict[str, Any]:
    env: dict[str, Any] = {"v": 1, "id": 42, "ok": True, "body": {}}
    env.update(fields)
    return {k: v for k, v in env.items() if v is not MISSING}


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        (reply_env(ok=MISSING), "ok"),
        (reply_env(ok=1), "ok"),
        (reply_env(body=MISSING), "body"),
        (reply_env(body=[]), "body"),
        (reply_env(error={"code": "BUSY", "message": "", "retryable": True}), "error"),
        (reply_env(ok=False, body=MISSING), "error"),
        (reply_env(ok=False, body=MISSING, error="BUSY"), "error"),
        (reply_env(ok=False, error={"code": "BUSY", "message": "", "retryable": True}), "body"),
        (reply_env(extra=0), "extra"),
    ],
)
def test_reply_envelope_rules(env: dict[str, Any], fragment: str) -> None:
    rejected(packed(env), BAD, 42, fragment, reply=True)


def test_reply_version_and_id() -> None:
    rejected(packed(reply_env(v=3)), ErrorCode.UNSUPPORTED_VERSION, 42, reply=True)
    rejected(packed(reply_env(id="x")), BAD, None, "id", reply=True)


def test_error_reply_with_frames_is_refused() -> None:
    env = reply_env(
        ok=False, body=MISSING, error={"code": "BUSY", "message": "", "retryable": True}
    )
    rejected(packed(env, b"x"), BAD, 42, "extra frames", reply=True)


def test_malformed_wire_error_becomes_internal_error() -> None:
    env = reply_env(ok=False, body=MISSING, error={"code": "BUSY"})
    reply = decode_reply(packed(env))
    assert isinstance(reply.error, InternalError) and "message" in reply.error.message
    with pytest.raises(InternalError):
        reply.unwrap()


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
    ErrorCode.SHUTTING_DOWN: ShuttingDown,
    ErrorCode.INTERNAL: InternalError,
}


def test_every_code_has_its_class_and_family() -> None:
    assert set(CLASSES) == set(ErrorCode)
    retryable = {ErrorCode.BUSY, ErrorCode.WORKER_LOST, ErrorCode.TIMEOUT, ErrorCode.SHUTTING_DOWN}
    assert set(RETRYABLE) == retryable
    for code, cls in CLASSES.items():
        assert error_class(code) is cls and error_class(str(code)) is cls
        assert cls.code == code
        family = ServiceError if code in RETRYABLE or code == ErrorCode.INTERNAL else RequestError
        assert issubclass(cls, family)
    assert error_class("NO_SUCH_CODE") is InternalError


@pytest.mark.parametrize("code", list(ErrorCode))
@pytest.mark.parametrize("override", [None, True, False])
def test_errors_round_trip(code: ErrorCode, override: bool | None) -> None:
    sent = CLASSES[code]("what happened", retryable=override)
    assert sent.retryable == (code in RETRYABLE if override is None else override)
    assert str(sent) == f"{code}: what happened"
    reply = decode_reply(encode_error(77, sent))
    assert (reply.id, reply.ok, reply.body) == (77, False, {})
    got = reply.error
    assert type(got) is CLASSES[code]
    assert got is not None and (got.code, got.message, got.retryable) == (
        code,
        "what happened",
        sent.retryable,
    )


def test_unknown_wire_code_keeps_the_message_and_retryable() -> None:
    err = error_from_wire({"code": "QUOTA", "message": "over quota", "retryable": True})
    assert isinstance(err, InternalError) and err.retryable
    assert "QUOTA" in err.message and "over quota" in err.message


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
def test_malformed_wire_errors(wire: Any) -> None:
    err = error_from_wire(wire)
    assert type(err) is InternalError and err.code == ErrorCode.INTERNAL
    assert "malformed" in err.message


def test_decode_error_maps_to_a_wire_error() -> None:
    err = rejected(packed(envelope(v=9)), ErrorCode.UNSUPPORTED_VERSION, 42)
    wire_error = err.to_error()
    assert isinstance(wire_error, UnsupportedVersion) and not wire_error.retryable
    assert str(err).startswith("UNSUPPORTED_VERSION: ")


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_frames"):
        Limits(max_frames=0)


# ---------------------------------------------------------------------------- bundles


def _envelope(request_id: int, body: dict[str, Any] | None = None) -> bytes:
    frames = encode_request(request_id, "step", body if body is not None else {"i": request_id})
    assert len(frames) == 1
    return bytes(frames[0])


@pytest.mark.parametrize("n", [1, 2, 15, 16, 300])  # fixarray and array16 headers
def test_a_bundle_carries_requests_that_decode_as_if_sent_alone(n: int) -> None:
    envelopes = [_envelope(i + 1) for i in range(n)]
    decoded = decode_requests([bundle(envelopes)])
    assert [r.id for r in decoded if isinstance(r, Request)] == list(range(1, n + 1))
    assert decoded == [decode_request([e]) for e in envelopes]


def test_bundles_packs_envelopes_in_order_into_messages_of_bounded_size() -> None:
    small = [_envelope(i, {"x": "a" * 40}) for i in range(1, 8)]  # ~60 bytes each
    large = _envelope(8, {"x": "b" * 500})
    messages = bundles([*small[:3], large, *small[3:]], max_bytes=200)
    assert [count for count, _ in messages] == [3, 1, 3, 1]
    assert messages[1][1] == large  # larger than max_bytes: alone, as itself
    assert all(len(m) <= 200 for i, (_, m) in enumerate(messages) if i != 1)
    ids = [r.id for _, m in messages for r in decode_requests([m]) if isinstance(r, Request)]
    assert ids == [1, 2, 3, 8, 4, 5, 6, 7]
    assert bundles([small[0]]) == [(1, small[0])]


def test_a_bad_envelope_in_a_bundle_fails_alone_with_its_id_when_it_can_be_read() -> None:
    wrong_version = msgpack.packb({"v": 9, "id": 2, "op": "step", "body": {}})
    no_id = msgpack.packb({"v": 1, "op": "step", "body": {}})
    not_a_map = msgpack.packb([1, 2])
    bad_body = msgpack.packb({"v": 1, "id": 5, "op": "step", "body": {"x": {"$tensor": 1}}})
    out = decode_requests(
        [bundle([_envelope(1), wrong_version, no_id, not_a_map, bad_body, _envelope(6)])]
    )
    assert isinstance(out[0], Request) and out[0].id == 1
    assert isinstance(out[1], DecodeError) and out[1].request_id == 2
    assert out[1].code == ErrorCode.UNSUPPORTED_VERSION
    assert isinstance(out[2], DecodeError) and out[2].request_id is None
    assert isinstance(out[3], DecodeError) and out[3].request_id is None
    assert isinstance(out[4], DecodeError) and out[4].request_id == 5
    assert out[4].code == ErrorCode.BAD_REQUEST and "$tensor" in out[4].message
    assert isinstance(out[5], Request) and out[5].id == 6


def test_a_bundle_with_a_frame_no_tensor_uses_fails_every_request_in_it() -> None:
    out = decode_requests([bundle([_envelope(1), _envelope(2)]), b"stray"])
    assert all(isinstance(x, DecodeError) and "extra frames" in x.message for x in out)
    assert [x.request_id for x in out if isinstance(x, DecodeError)] == [1, 2]


def test_a_bundle_over_a_limit_as_a_whole_fails_each_request_it_can_name() -> None:
    """Too large, or a string over its limit: the bundle cannot be unpacked, yet every
    envelope whose id can be read hears why (so its sender does not wait for nothing)."""
    limits = Limits(max_envelope_bytes=600, max_str_bytes=100)
    big = [_envelope(i, {"x": "a" * 90}) for i in (1, 2, 3, 4, 5, 6)]  # ~110 bytes each
    long_str = [_envelope(7), _envelope(8, {"x": "b" * 200}), msgpack.packb("not a map")]
    no_id = msgpack.packb({"v": 1, "op": "step", "body": {}, 3: 4})  # an int key, too
    for envelopes, ids, reason in (
        (big, [1, 2, 3, 4, 5, 6], "over the limit"),
        ([*long_str, no_id], [7, 8, None, None], "not valid msgpack or over a limit"),
    ):
        out = decode_requests([bundle(envelopes)], limits)
        assert [x.request_id for x in out if isinstance(x, DecodeError)] == ids
        assert all(isinstance(x, DecodeError) and reason in x.message for x in out)
    with pytest.raises(DecodeError) as err:  # not a bundle: the one id, raised
        decode_requests([_envelope(9, {"x": "c" * 700})], limits)
    assert err.value.request_id == 9


def test_empty_bundles_and_bundles_where_one_message_is_expected_are_refused() -> None:
    with pytest.raises(DecodeError, match="empty"):
        decode_requests([b"\x90"])
    with pytest.raises(DecodeError, match="must be a map"):
        decode_request([bundle([_envelope(1)])])
    with pytest.raises(DecodeError, match="must be a map"):
        decode_reply([bundle([encode_reply(1, {})[0]])])
    with pytest.raises(ValueError, match="1 to 65535"):
        bundle([])


def test_replies_bundle_as_requests_do() -> None:
    out_tensor = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    ok = encode_outputs_reply(1, {"out": out_tensor}, {"bucket": 2})
    error = encode_error(2, Busy("full"))
    assert len(ok) == 1 and len(error) == 1  # small tensors travel inline
    replies = decode_replies([bundle([bytes(ok[0]), bytes(error[0])])])
    first, second = replies
    assert isinstance(first, Reply) and first.ok and first.body["bucket"] == 2
    assert torch.equal(first.body["outputs"]["out"], out_tensor)
    assert isinstance(second, Reply) and second.error is not None
    assert second.error.code == ErrorCode.BUSY


def test_the_outputs_reply_is_what_the_general_encoder_makes() -> None:
    t = torch.randn(4, 64)  # 1 KiB and over: a data frame
    small = torch.ones(3, dtype=torch.int32)
    fields = {"bucket": 4, "slot": 1, "patched": 2, "server_us": 12.5}
    fast = encode_outputs_reply(7, {"out": t, "lse": small}, fields)
    general = encode_reply(7, {"outputs": {"out": t, "lse": small}, **fields})
    assert [bytes(f) for f in fast] == [bytes(f) for f in general]
    with pytest.raises(ValueError, match=r"body\.outputs\.out: must be a tensor"):
        encode_outputs_reply(7, {"out": [1, 2]}, {})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="complex64"):
        encode_outputs_reply(7, {"out": torch.zeros(1, dtype=torch.complex64)}, {})


def test_the_reused_packer_is_clean_after_a_failed_pack() -> None:
    """Envelopes are packed by a reused msgpack.Packer: a failed pack leaves nothing
    behind for the next envelope."""
    from graphlane.protocol import codec as codec_mod

    with pytest.raises(TypeError):
        codec_mod._pack({"a": [1, 2, object()]})
    assert msgpack.unpackb(codec_mod._pack({"b": 2})) == {"b": 2}
