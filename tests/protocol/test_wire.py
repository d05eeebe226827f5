"""The wire: frames and limits, envelopes, tensors, bundles and error replies.

Bodies here are those of ``step`` (the op that carries tensors); every op's own
fields are in test_ops.py. Refusals are checked by code, request id and the field
named, never by message text.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
import torch
import zmq

from graphlane.protocol import (
    DEFAULT_LIMITS,
    INLINE_TENSOR_BYTES,
    TENSOR_KEY,
    WIRE_DTYPES,
    Codec,
    DecodeError,
    ErrorCode,
    Limits,
    Request,
    UnsupportedVersion,
    encode_request,
    ops,
    tensor_ref,
)
from graphlane.protocol.ops.steps import DeviceValues


def decode_requests(frames: Any, limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    return Codec(limits).decode_requests(frames)


def decode_replies(frames: Any, limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    return Codec(limits).decode_replies(frames)


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
    """Address of the first byte of a buffer."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def envelope(**fields: Any) -> dict[str, Any]:
    env: dict[str, Any] = {"v": 1, "id": 42, "op": "step", "body": {"program": "p", "device": 0}}
    env.update(fields)
    return {k: v for k, v in env.items() if v is not MISSING}


def packed(env: Any, *frames: Any) -> list[Any]:
    return [msgpack.packb(env, use_bin_type=True), *frames]


def one(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Request | DecodeError:
    (item,) = decode_requests(frames, limits)
    return item


def refused(item: Any, code: ErrorCode, request_id: int | None, field: str = "") -> DecodeError:
    assert isinstance(item, DecodeError), item
    assert (item.code, item.request_id) == (code, request_id), item
    assert field in item.message, item
    return item


def refused_unread(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> None:
    """The message as a whole is refused: nobody to answer."""
    with pytest.raises(DecodeError) as info:
        decode_requests(frames, limits)
    refused(info.value, BAD, None)


def step_of(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> ops.Step:
    req = one(frames, limits)
    assert isinstance(req, Request), req
    body: ops.Step = req.body
    return body


def body_refused(frames: Sequence[Any], field: str, limits: Limits = DEFAULT_LIMITS) -> None:
    refused(one(frames, limits), BAD, 42, field)


def inputs(**tensors: torch.Tensor) -> list[Any]:
    return encode_request(1, "step", ops.Step("p", 0, inputs=tensors))


# --------------------------------------------------------------------------- round trips

SHAPES = [(), (0,), (3, 5), (2, 0, 3), (40, 40)]


@pytest.mark.parametrize("dtype_name", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensor_round_trip(dtype_name: str, shape: tuple[int, ...]) -> None:
    dtype = WIRE_DTYPES[dtype_name]
    t = sample(dtype, shape)
    frames = inputs(x=t)
    large = t.numel() * t.element_size() > INLINE_TENSOR_BYTES
    assert len(frames) == (2 if large else 1)
    wire = msgpack.unpackb(frames[0])["body"]["inputs"]["x"][TENSOR_KEY]
    assert wire["dtype"] == dtype_name and wire["shape"] == list(shape)
    assert ("frame" in wire) == large and ("data" in wire) == (not large)
    got = step_of(frames).inputs["x"]
    assert got.dtype == dtype and tuple(got.shape) == shape and torch.equal(got, t)


@pytest.mark.parametrize("dtype_name", sorted(WIRE_DTYPES))
def test_non_contiguous_tensors_round_trip(dtype_name: str) -> None:
    base = sample(WIRE_DTYPES[dtype_name], (64, 48))
    views = {"t": base.t(), "step": base[::2, 1::3], "small": base[:4, :4].t()}
    assert not any(v.is_contiguous() for v in views.values())
    got = step_of(inputs(**views)).inputs
    for name, view in views.items():
        assert torch.equal(got[name], view), name


def test_tensors_with_autograd_or_lazy_bits_are_sent_as_their_values() -> None:
    grad = torch.ones(4, requires_grad=True)
    neg = torch.arange(4.0)._neg_view()
    got = step_of(inputs(grad=grad, neg=neg)).inputs
    assert torch.equal(got["grad"], grad.detach()) and got["neg"].tolist() == [0, -1, -2, -3]


def test_tensor_ref_appends_frames_numbered_from_one() -> None:
    frames: list[Any] = [b"already"]
    ref = tensor_ref(torch.zeros(1000), frames)
    assert (ref.spec.dtype, ref.spec.shape, ref.spec.frame, ref.spec.data) == (
        "float32",
        [1000],
        2,
        None,
    )
    assert len(frames) == 2
    small = tensor_ref(torch.zeros(2, dtype=torch.int16), frames)
    assert small.spec.data == bytes(4) and small.spec.frame is None and len(frames) == 2


def test_the_encoder_writes_each_tensor_as_its_tensor_ref_encodes() -> None:
    """The encoder's hook writes a tensor's reference as plain maps (no Struct per
    tensor): byte for byte what the TensorRef of :func:`tensor_ref` encodes to."""
    import msgspec

    small, large = torch.arange(4), torch.zeros(1000)
    frames = Codec().encode_reply(7, {"a": small, "b": large})
    expect: list[Any] = []
    refs = {"a": tensor_ref(small, expect), "b": tensor_ref(large, expect)}
    env = {"v": 1, "id": 7, "ok": True, "body": refs}
    assert bytes(frames[0]) == msgspec.msgpack.encode(env)
    assert len(frames) == 2 and bytes(frames[1]) == bytes(expect[0])


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://wire")
        b.connect("inproc://wire")
        yield a, b
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.destroy(linger=0)


def test_over_a_real_socket_tensors_view_the_received_frames(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    a, b = pair
    t = torch.randn(128, 64).to(torch.bfloat16)
    a.send_multipart(encode_request(5, "step", ops.Step("p", 0, inputs={"q": t})), copy=False)
    received = b.recv_multipart(copy=False)
    got = step_of(received).inputs["q"]
    assert torch.equal(got, t) and got.data_ptr() == address(received[1].buffer)


# ------------------------------------------------------------------------------ zero copy


def test_large_contiguous_tensor_is_sent_without_copy() -> None:
    t = torch.randn(64, 64)
    frame = inputs(x=t)[1]
    assert isinstance(frame, memoryview) and frame.nbytes == t.numel() * 4
    assert address(frame) == t.data_ptr()
    t[0, 0] = 1234.5  # the frame is the tensor's memory
    assert np.frombuffer(frame, dtype=np.float32)[0] == 1234.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.bool, torch.int64])
def test_zero_copy_for_every_itemsize_and_offset(dtype: torch.dtype) -> None:
    t = sample(dtype, (3000,))[1000:]  # contiguous, with a storage offset
    assert address(inputs(x=t)[1]) == t.data_ptr()


def test_non_contiguous_tensor_is_copied_once() -> None:
    t = torch.randn(64, 64).t()
    frame = inputs(x=t)[1]
    assert address(frame) != t.data_ptr()
    assert bytes(frame) == t.contiguous().numpy().tobytes()


@pytest.mark.parametrize("kind", [bytearray, bytes, zmq.Frame])
def test_decoded_tensor_views_the_received_buffer(kind: Any) -> None:
    """A view, also of a read-only frame (and without the warning torch gives for one)."""
    t = torch.arange(1024, dtype=torch.float32)
    received = kind(t.numpy().tobytes())
    got = step_of([inputs(x=t)[0], received]).inputs["x"]
    buf = received.buffer if kind is zmq.Frame else received
    assert got.data_ptr() == address(buf) and torch.equal(got, t)
    if kind is bytearray:
        received[0:4] = np.float32(-7.0).tobytes()
        assert got[0].item() == -7.0


def test_inline_tensors_are_writable_copies() -> None:
    got = step_of(inputs(x=torch.zeros(4))).inputs["x"]
    got += 1
    assert got.tolist() == [1, 1, 1, 1]


def test_misaligned_frames_are_copied_to_an_aligned_tensor() -> None:
    t = torch.arange(300, dtype=torch.float64)
    buf = bytearray(1 + 300 * 8)
    buf[1:] = t.numpy().tobytes()
    got = step_of([inputs(x=t)[0], memoryview(buf)[1:]]).inputs["x"]
    assert got.data_ptr() % 8 == 0 and torch.equal(got, t)


def test_a_frame_in_another_format_counts_its_bytes() -> None:
    t = torch.arange(300, dtype=torch.float32)
    as_floats = memoryview(t.numpy().copy())  # format "f": len() counts floats
    assert torch.equal(step_of([inputs(x=t)[0], as_floats]).inputs["x"], t)


# ------------------------------------------------------------------------------- encoding


def test_numpy_scalars_and_arrays_encode_as_plain_values() -> None:
    step = ops.Step(
        "p",
        np.int64(2),
        {"lens": np.arange(3, dtype=np.int32), "scale": np.float32(0.5), "on": np.bool_(True)},
        batch=np.uint8(3),
    )
    got = step_of(encode_request(1, "step", step))
    assert (got.device, got.batch) == (2, 3)
    assert got.params == {"lens": [0, 1, 2], "scale": 0.5, "on": True}
    assert type(got.params["lens"][0]) is int and type(got.device) is int


def _cycle() -> list[Any]:
    cycle: list[Any] = []
    cycle.append(cycle)
    return cycle


@pytest.mark.parametrize(
    "step",
    [
        ops.Step("p", 0, {"x": object()}),
        ops.Step("p", 2**64),
        ops.Step("p", -(2**63) - 1),
        ops.Step("p", 0, {"x": _cycle()}),
        ops.Step("p", 0, inputs={"x": torch.zeros(2, dtype=torch.complex64)}),
        ops.Step("p", 0, inputs={"x": torch.zeros(2, device="meta")}),
        ops.Step("p", 0, inputs={"x": torch.zeros(3, 3).to_sparse()}),
    ],
    ids=["object", "over-uint64", "under-int64", "cycle", "complex", "meta", "sparse"],
)
def test_unsendable_values_are_a_value_error(step: ops.Step) -> None:
    with pytest.raises(ValueError):
        encode_request(1, "step", step)


# ------------------------------------------------------------------- frames and limits


def test_garbage_and_no_frames_are_refused_without_an_id() -> None:
    refused(one([b"\xc1\xff garbage"]), BAD, None, "envelope")
    refused_unread([])


@pytest.mark.parametrize(
    "frames",
    [[b"\x80", 5], b"\x80", [object()]],
    ids=["[b'\\x80', 5]", "b'\\x80'", "[object()]"],  # the same in every process (xdist)
)
def test_frames_that_are_not_byte_buffers(frames: Any) -> None:
    refused_unread(frames)


@pytest.mark.parametrize(
    ("extra", "limits"),
    [
        ([b"a", b"b", b"c"], Limits(max_frames=3)),
        ([bytes(200)], Limits(max_message_bytes=100)),
        ([], Limits(max_envelope_bytes=20)),
    ],
    ids=["frame count", "message bytes", "envelope bytes"],
)
def test_limits_are_checked_before_any_byte_is_decoded(extra: list[bytes], limits: Limits) -> None:
    """The envelope is sound, yet it is not read: TOO_LARGE, to the id its first bytes name."""
    frames = packed(envelope(), *extra)
    read = one(frames)  # frames no tensor references are refused, once read
    assert isinstance(read, Request) or read.code == BAD
    with pytest.raises(DecodeError) as info:
        decode_requests(frames, limits)
    refused(info.value, ErrorCode.TOO_LARGE, 42)


@pytest.mark.parametrize("field", ["max_frames", "max_tensor_dims", "max_message_bytes"])
@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_limits_must_be_positive_ints(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        Limits(**{field: value})


# ------------------------------------------------------------------------------ envelope


@pytest.mark.parametrize("value", ["step", 42, None, b"\x80"])
def test_envelope_must_be_a_map(value: Any) -> None:
    refused(one(packed(value)), BAD, None, "envelope")


def test_an_array_is_a_bundle_whose_items_fail_alone() -> None:
    out = decode_requests(packed([1, 42, "step", {}]))
    assert len(out) == 4
    for item in out:
        refused(item, BAD, None, "envelope")


@pytest.mark.parametrize("bad_id", [MISSING, -1, True, "42", 1.0, None, 2**64 - 1 + 0.0])
def test_id_must_be_uint64_else_nobody_is_answered(bad_id: Any) -> None:
    refused(one(packed(envelope(id=bad_id))), BAD, None, "envelope.id")


def test_the_largest_id_is_kept() -> None:
    req = one(packed(envelope(id=2**64 - 1)))
    assert isinstance(req, Request) and req.id == 2**64 - 1


def test_version_missing_is_a_bad_request() -> None:
    refused(one(packed(envelope(v=MISSING))), BAD, 42, "envelope.v")


@pytest.mark.parametrize("version", [0, 2, "1", True, 1.0, None])
def test_other_versions_are_unsupported(version: Any) -> None:
    err = refused(one(packed(envelope(v=version))), ErrorCode.UNSUPPORTED_VERSION, 42)
    assert isinstance(err.to_error(), UnsupportedVersion) and not err.to_error().retryable
    assert str(err).startswith("UNSUPPORTED_VERSION: ")


def test_another_versions_envelope_need_not_fit_this_ones() -> None:
    """A v2 envelope with a key v1 does not know is UNSUPPORTED_VERSION, not a
    complaint about that key."""
    refused(one(packed({"id": 7, "v": 2, "op": 5, "junk": 1})), ErrorCode.UNSUPPORTED_VERSION, 7)


@pytest.mark.parametrize("op", [MISSING, 5, "", None, "x" * 129])
def test_op_must_be_a_short_non_empty_str(op: Any) -> None:
    refused(one(packed(envelope(op=op))), BAD, 42, "envelope.op")


def test_unknown_envelope_key() -> None:
    refused(one(packed(envelope(extra=1))), BAD, 42, "extra")


@pytest.mark.parametrize("body", [[], "x", None, 5])
def test_a_body_that_is_no_map_is_refused_with_the_id(body: Any) -> None:
    body_refused(packed(envelope(body=body)), "body")


def test_an_unknown_op_is_refused_with_the_id_naming_the_op() -> None:
    refused(one(packed(envelope(op="stpe"))), BAD, 42, "stpe")


def test_a_broken_envelope_names_its_id_when_it_can() -> None:
    """Leniently read: from a map with bad fields, from a truncated map up to the
    break; an id after the break, or no id at all, cannot be answered."""
    id_first = msgpack.packb({"id": 5, "v": 1, "op": "step", "body": {"a": "x" * 50}})
    id_last = msgpack.packb({"v": 1, "op": "step", "body": {"a": "x" * 50}, "id": 5})
    refused(one([id_first[:30]]), BAD, 5, "envelope")
    refused(one([id_last[:30]]), BAD, None, "envelope")
    refused(one(packed({"id": 6, "v": 1, "body": {}})), BAD, 6, "envelope.op")
    refused(one(packed({"id": 6, "v": 1, "op": "step", 3: 4})), BAD, 6, "envelope")
    v9 = msgpack.packb({"id": 8, "v": 9, "op": "step"})[:-1]
    refused(one([v9]), ErrorCode.UNSUPPORTED_VERSION, 8)


# -------------------------------------------------------------------------------- tensors


def tspec(dtype: Any = "float32", shape: Any = (2,), **fields: Any) -> dict[str, Any]:
    spec = {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape}
    spec.update(fields)
    return {TENSOR_KEY: {k: v for k, v in spec.items() if v is not MISSING}}


def bad_tensor(
    spec: Any, *frames: bytes, field: str = "body.inputs[...]", limits: Limits = DEFAULT_LIMITS
) -> None:
    body = {"program": "p", "device": 0, "inputs": {"query": spec}}
    body_refused(packed(envelope(body=body), *frames), field, limits)


@pytest.mark.parametrize("dtype", ["complex64", "uint16", 5, None, MISSING, ["float32"]])
def test_tensor_dtype_must_be_known(dtype: Any) -> None:
    bad_tensor(tspec(dtype=dtype, data=bytes(8)), field="body.inputs[...].$tensor.dtype")


@pytest.mark.parametrize("shape", [MISSING, "2", [2, -1], [2, True], [2.0], [1] * 9, [[2]], None])
def test_tensor_shape_must_be_a_short_list_of_naturals(shape: Any) -> None:
    bad_tensor(tspec(shape=shape, data=bytes(8)), field="body.inputs[...].$tensor.shape")


@pytest.mark.parametrize(
    ("spec", "limits"),
    [
        (tspec(shape=(1024,), frame=1), Limits(max_tensor_bytes=1000)),
        (tspec(dtype="uint8", shape=(1, 1, 1, 1), data=b"\0"), Limits(max_tensor_dims=3)),
        (tspec(shape=(2**40, 2**40), frame=1), DEFAULT_LIMITS),  # before looking for bytes
        (tspec(shape=(0, 2**40, 2**40), data=b""), DEFAULT_LIMITS),  # empty, yet too large
        (tspec(shape=(0, 2**64 - 1), frame=1), DEFAULT_LIMITS),
    ],
    ids=["bytes", "dims", "huge", "empty-huge", "empty-uint64"],
)
def test_tensor_limits(spec: dict[str, Any], limits: Limits) -> None:
    bad_tensor(spec, bytes(4096), field="body.inputs[...].$tensor", limits=limits)


@pytest.mark.parametrize("index", [0, 2, -1, True, "1", None])
def test_tensor_frame_index_must_exist(index: Any) -> None:
    bad_tensor(tspec(frame=index), bytes(8), field="body.inputs[...].$tensor")


@pytest.mark.parametrize(
    ("spec", "frames", "field"),
    [
        pytest.param(tspec(frame=1), [bytes(12)], "", id="frame-length"),
        pytest.param(tspec(data=bytes(7)), [], "", id="data-length"),
        pytest.param(tspec(data="12345678"), [], ".data", id="data-str"),
        pytest.param(tspec(data="AAAAAAAAAAA="), [], ".data", id="data-base64-str"),
        pytest.param(tspec(frame=1, data=bytes(8)), [bytes(8)], "", id="both"),
        pytest.param(tspec(), [], "", id="neither"),
        pytest.param(tspec(data=bytes(8), strides=[1]), [], ".strides", id="unknown-field"),
        pytest.param({TENSOR_KEY: [1]}, [], "", id="not-a-map"),
        pytest.param(tspec(dtype="bool", data=b"\x01\x02"), [], "", id="bool-not-0-or-1"),
    ],
)
def test_tensor_spec_rules(spec: dict[str, Any], frames: list[bytes], field: str) -> None:
    bad_tensor(spec, *frames, field=f"body.inputs[...].$tensor{field}")


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ([1.0], ""),
        (1, ""),
        ({**tspec(data=bytes(8)), "other": 1}, ".other"),
        ({"dtype": "int8"}, ".dtype"),
    ],
)
def test_a_tensor_is_a_one_key_map(value: Any, field: str) -> None:
    bad_tensor(value, field=f"body.inputs[...]{field}")


def test_bool_frame_bytes_must_be_0_or_1() -> None:
    bad_tensor(tspec(dtype="bool", shape=(2000,), frame=1), bytes(1999) + b"\x07")


def test_frame_referenced_twice() -> None:
    query, keys = tspec(shape=(300,), frame=1), tspec(shape=(300,), frame=1)
    body = {"program": "p", "device": 0, "inputs": {"query": query, "keys": keys}}
    body_refused(packed(envelope(body=body), bytes(1200)), "body.inputs[...].$tensor")


def test_frames_no_tensor_references_are_refused() -> None:
    bad_tensor(tspec(shape=(300,), frame=1), bytes(1200), b"extra", field="body")
    body_refused(packed(envelope(), b"stray"), "body")


def test_a_tensor_where_its_type_has_none_is_refused() -> None:
    body_refused(packed(envelope(body=tspec(data=bytes(8)))), "body")
    body = {"program": "p", "device": 0, "params": {"x": tspec(data=bytes(8))}}
    body_refused(packed(envelope(body=body)), "body.params[...]")


# ------------------------------------------------------------------ replies as lists


def reply_of(frames: Sequence[Any]) -> Any:
    (reply,) = decode_replies(frames)
    return reply


@pytest.mark.parametrize("dtype_name", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("shape", [*SHAPES, (1, 2, 1, 8), (300,)], ids=str)
def test_a_replys_tensors_as_lists_are_their_tolist(
    dtype_name: str, shape: tuple[int, ...]
) -> None:
    """``Reply.body(op, lists=True)`` (the client's ``decode(as_lists=True)``): each
    output is what the tensor's ``tolist()`` gives, inline or in a frame of its own, and
    read from the bytes without a tensor where memoryview has the dtype's format."""
    t = sample(WIRE_DTYPES[dtype_name], shape)
    frames = Codec().encode_reply(5, ops.DeviceResult({"x": t, "y": t.flatten()[:1]}))
    received = [bytes(f) for f in frames]
    op = ops.OPS["decode"]
    as_tensors = reply_of(received).body(op).outputs
    as_lists = reply_of(received).body(op, lists=True).outputs
    assert as_lists == {"x": t.tolist(), "y": t.flatten()[:1].tolist()}
    assert as_lists == {k: v.tolist() for k, v in as_tensors.items()}
    leaves = as_lists["x"]
    while isinstance(leaves, list) and leaves and isinstance(leaves[0], list):
        leaves = leaves[0]
    if shape and all(shape):
        assert type(leaves[0]) is type(t.flatten()[0].item())  # (Python numbers)


def test_lists_are_checked_as_tensors_are() -> None:
    """What a tensor is refused for, its values as lists are refused for too: bool bytes
    other than 0 and 1, bytes that do not fill the shape, a frame nobody names."""
    op = ops.OPS["decode"]
    env = Codec().encode_reply(5, ops.DeviceResult({"x": torch.ones(3, dtype=torch.bool)}))[0]
    spoiled = env.replace(b"\x01\x01\x01", b"\x01\x02\x01")
    short = env.replace(b"\xc4\x03\x01\x01\x01", b"\xc4\x02\x01\x01")
    for frames in ([spoiled], [short], [env, b"extra"]):
        for lists in (False, True):
            with pytest.raises(DecodeError):
                reply_of(frames).body(op, lists=lists)
    assert reply_of([env]).body(op, lists=True).outputs == {"x": [True, True, True]}


def test_the_values_reading_of_a_device_result_keeps_its_fields() -> None:
    """``DeviceValues`` (a DeviceResult read for lists) has DeviceResult's fields, in its
    order, with its defaults and types, but for its outputs' references: a field added to
    one and not the other would be dropped from every ``decode(as_lists=True)``."""
    result = msgspec.structs.fields(ops.DeviceResult)
    values = msgspec.structs.fields(DeviceValues)
    assert [f.name for f in values] == [f.name for f in result]
    for r, v in zip(result, values, strict=True):
        assert (r.default, r.default_factory) == (v.default, v.default_factory), r.name
        if r.name != "outputs":
            assert r.type == v.type, r.name
    body = ops.DeviceResult({"t": torch.arange(3)}, 8, 1, 20, 12.5, 7)
    (reply,) = decode_replies(Codec().encode_reply(5, body))
    as_lists = reply.body(ops.OPS["decode"], lists=True)
    assert {f.name: getattr(as_lists, f.name) for f in values} == {
        "outputs": {"t": [0, 1, 2]}, "bucket": 8, "instance": 1, "patched": 20,
        "server_us": 12.5, "generation": 7,
    }  # fmt: skip
