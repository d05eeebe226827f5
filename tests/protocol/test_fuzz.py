"""Whatever arrives, decoding returns a well-formed value or raises DecodeError: nothing else."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hostile
import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphlane.protocol import (
    DEFAULT_LIMITS,
    OPS,
    TENSOR_KEY,
    WIRE_DTYPES,
    Codec,
    DecodeError,
    ErrorCode,
    Limits,
    Reply,
    Request,
    bundle,
    encode_error,
    encode_reply,
    encode_request,
    ops,
)
from graphlane.protocol.admission import check_outgoing, walk
from graphlane.protocol.errors import Busy, GraphlaneError, TooLarge


def decode_requests(frames: Any, limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    return Codec(limits).decode_requests(frames)


def decode_replies(frames: Any, limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    return Codec(limits).decode_replies(frames)


FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,  # leave no files behind
    # The autouse device fixture runs once per test, not per example: that is fine here.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

TIGHT = Limits(
    max_message_bytes=8192,
    max_frames=4,
    max_envelope_bytes=2048,
    max_tensor_bytes=2048,
    max_tensor_dims=3,
)
limits_st = st.sampled_from([DEFAULT_LIMITS, TIGHT])


# ------------------------------------------------------------------------------- checks


def check_value(value: Any, limits: Limits) -> None:
    """A decoded body holds only the documented types, tensors within the limits."""
    if isinstance(value, torch.Tensor):
        assert value.dtype in WIRE_DTYPES.values() and value.device.type == "cpu"
        assert value.dim() <= limits.max_tensor_dims
        assert value.numel() * value.element_size() <= limits.max_tensor_bytes
    elif isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str)
            check_value(item, limits)
    elif isinstance(value, list | tuple):
        for item in value:
            check_value(item, limits)
    elif hasattr(value, "__struct_fields__"):
        for name in value.__struct_fields__:
            check_value(getattr(value, name), limits)
    else:
        assert value is None or isinstance(value, bool | int | float | str | bytes)


def check_refusal(exc: DecodeError) -> None:
    assert exc.code in set(ErrorCode)
    assert exc.request_id is None or 0 <= exc.request_id < 2**64


def check_result(result: Request | Reply, limits: Limits) -> None:
    """The envelope is sound; its body, read with every op's type that could apply,
    is a typed value or a DecodeError naming its id."""
    assert 0 <= result.id < 2**64
    if isinstance(result, Request):  # decoded with its body
        assert result.op in OPS and type(result.body) is OPS[result.op].request
        check_value(result.body, limits)
        return
    for op in OPS.values():
        try:
            check_value(result.body(op), limits)
        except DecodeError as exc:
            check_refusal(exc)
            assert exc.request_id == result.id
        except GraphlaneError:  # an error reply raises its error
            assert isinstance(result, Reply) and result.error is not None


def decodes_or_refuses(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> None:
    """Single envelopes and bundles alike: a value, or DecodeError (for the message,
    or in place of one envelope of a bundle)."""
    for decode_each in (decode_requests, decode_replies):
        try:
            items: list[Any] = decode_each(frames, limits)
        except DecodeError as exc:
            check_refusal(exc)
            continue
        assert items
        for item in items:
            if isinstance(item, DecodeError):
                check_refusal(item)
            else:
                check_result(item, limits)


# -------------------------------------------------------------------------- 1: raw bytes


@FUZZ
@given(st.binary(max_size=4096), limits_st)
def test_any_bytes_as_one_frame(data: bytes, limits: Limits) -> None:
    decodes_or_refuses([data], limits)


@FUZZ
@given(st.lists(st.binary(max_size=1024), max_size=6), limits_st)
def test_any_bytes_as_several_frames(frames: list[bytes], limits: Limits) -> None:
    decodes_or_refuses(frames, limits)


# ------------------------------------------------------------------- 2: structured values

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
keys = st.sampled_from(["v", "id", "op", "body", "ok", "error", "x", "dtype", "shape"]) | st.text(
    max_size=8
)
tensor_specs = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from([*WIRE_DTYPES, "complex64"]) | scalars,
        "shape": st.lists(st.integers(-2, 40), max_size=4) | scalars,
        "frame": st.integers(-1, 4) | scalars,
        "data": st.binary(max_size=64) | scalars,
    },
).map(lambda spec: {TENSOR_KEY: spec})
values = st.recursive(
    scalars | tensor_specs,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(keys, children, max_size=5),
    max_leaves=30,
)
envelopes = st.fixed_dictionaries(
    {},
    optional={
        "v": st.just(1) | values,
        "id": st.integers(0, 2**64 - 1) | values,
        "op": st.sampled_from(["step", "hello", "drain"]) | values,
        "ok": st.booleans() | values,
        "body": st.dictionaries(keys, values, max_size=6) | values,
        "error": st.fixed_dictionaries(
            {"code": st.sampled_from(list(ErrorCode)) | st.text(max_size=5), "message": st.text()}
        )
        | values,
        "extra": values,
    },
)


@FUZZ
@given(values, st.lists(st.binary(max_size=128), max_size=3), limits_st)
def test_any_msgpack_value_as_envelope(env: Any, extra: list[bytes], limits: Limits) -> None:
    decodes_or_refuses([msgpack.packb(env, use_bin_type=True), *extra], limits)


@FUZZ
@given(envelopes, st.lists(st.binary(max_size=256), max_size=3), limits_st)
def test_envelope_like_maps(env: dict[str, Any], extra: list[bytes], limits: Limits) -> None:
    decodes_or_refuses([msgpack.packb(env, use_bin_type=True), *extra], limits)


@FUZZ
@given(st.lists(envelopes | values, min_size=1, max_size=5), limits_st)
def test_arrays_of_envelope_like_maps_as_bundles(items: list[Any], limits: Limits) -> None:
    decodes_or_refuses([msgpack.packb(items, use_bin_type=True)], limits)


# ------------------------------------------------------------------ 3: mutated messages


def valid_messages() -> list[list[bytes]]:
    step = ops.Step(
        "attention",
        0,
        {"actual_seq_lengths_kv": [3, 1, 4], "scale": 0.5},
        {
            "query": torch.randn(3, 2, 64).half(),  # 768 bytes: inline
            "keys": torch.randn(3, 128),  # 1536 bytes: a frame
            "mask": torch.ones(1200, dtype=torch.bool),  # a frame
            "pos": torch.arange(3),
            "empty": torch.zeros(0, 4),
            "scalar": torch.tensor(2.0, dtype=torch.bfloat16),
        },
        ["out", "lse"],
    )
    done = ops.DeviceResult({"out": torch.randn(20, 20)}, 4, 1, 2, 12.5)
    messages: list[Sequence[bytes | memoryview]] = [
        encode_request(12345, "step", step),
        encode_reply(12345, done),
        encode_error(7, Busy("queue full")),
        [bundle([bytes(encode_request(i, "status", ops.Status())[0]) for i in (1, 2, 3)])],
        [bundle([bytes(encode_error(4, Busy("queue full"))[0]), bytes(encode_reply(5, {})[0])])],
    ]
    return [[bytes(frame) for frame in frames] for frames in messages]


VALID = valid_messages()


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    frames = [bytearray(frame) for frame in draw(st.sampled_from(VALID))]
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "drop", "dup", "swap"]))
        i = draw(st.integers(0, len(frames) - 1)) if frames else 0
        if kind in ("flip", "set") and frames and frames[i]:
            pos = draw(st.integers(0, len(frames[i]) - 1))
            if kind == "flip":
                frames[i][pos] ^= 1 << draw(st.integers(0, 7))
            else:
                frames[i][pos] = draw(st.integers(0, 255))
        elif kind == "truncate" and frames:
            del frames[i][draw(st.integers(0, len(frames[i]))) :]
        elif kind == "insert" and frames:
            pos = draw(st.integers(0, len(frames[i])))
            frames[i][pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "drop" and frames:
            del frames[i]
        elif kind == "dup" and frames:
            frames.insert(i, bytearray(frames[i]))
        elif kind == "swap" and len(frames) > 1:
            j = draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
    return [bytes(frame) for frame in frames]


def test_the_unmutated_messages_decode() -> None:
    (request,) = decode_requests(VALID[0])
    assert isinstance(request, Request) and request.id == 12345
    step = request.body
    assert step.inputs["mask"].dtype == torch.bool and step.params["scale"] == 0.5
    (reply,) = decode_replies(VALID[1])
    assert isinstance(reply, Reply) and reply.body(OPS["step"]).instance == 1
    (error,) = decode_replies(VALID[2])
    assert isinstance(error, Reply) and isinstance(error.error, Busy)


@FUZZ
@given(mutated(), limits_st)
def test_mutated_messages(frames: list[bytes], limits: Limits) -> None:
    decodes_or_refuses(frames, limits)


# ---------------------------------------------------------- 4: hostile, structure-aware


@FUZZ
@given(hostile.messages(), limits_st)
def test_hostile_messages(frames: list[bytes], limits: Limits) -> None:
    """Nested deep, wide, declaring more than they hold, wrong at any field of any op,
    frames cut or added: a value or a DecodeError, as ever."""
    decodes_or_refuses(frames, limits)
    # The worker's one-pass reading too (that it reads them alike: test_one_pass.py).
    for decode in (decode_requests,):
        try:
            decode(frames, limits)
        except DecodeError as exc:
            check_refusal(exc)


@pytest.mark.parametrize("depth", [33, 999, 1000, 5000, 100_000])
@pytest.mark.parametrize("where", ["body", "op last", "bundle", "reply body", "version"])
def test_a_value_nested_deeper_than_the_limit_is_a_bad_request_naming_its_id(
    depth: int, where: str
) -> None:
    deep = hostile.Packed(hostile.nested(depth), f"{depth} deep")
    if where == "body":
        frames = [hostile.pack({"v": 1, "id": 7, "op": "step", "body": {"params": deep}})]
    elif where == "op last":  # msgspec skips the body to find the tag
        frames = [hostile.pack({"v": 1, "id": 7, "body": deep, "op": "status"})]
    elif where == "bundle":
        good = bytes(encode_request(6, "status", ops.Status())[0])
        frames = [bundle([good, hostile.pack({"v": 1, "id": 7, "op": "status", "body": deep})])]
    elif where == "version":
        frames = [hostile.pack({"id": 7, "v": deep, "op": "status", "body": {}})]
    else:
        frames = [hostile.pack({"v": 1, "id": 7, "ok": True, "body": {"x": deep}})]
    if where == "reply body":
        (reply,) = decode_replies(frames)
        assert isinstance(reply, Reply) or reply.request_id == 7
        if isinstance(reply, Reply):
            with pytest.raises(DecodeError) as info:
                reply.body(OPS["status"])  # an untyped map: walked first
            assert info.value.request_id == 7
        return
    for decode in (decode_requests,):
        items = decode(frames)
        refusal = items[-1]
        assert isinstance(refusal, DecodeError), refusal
        assert (refusal.code, refusal.request_id) == (ErrorCode.BAD_REQUEST, 7)
        assert "deeper than" in refusal.message
        if where == "bundle":
            assert isinstance(items[0], Request) and items[0].id == 6


def test_deep_values_need_no_stack() -> None:
    """On a thread with a small stack (64 KiB), where a recursive decode of a value
    100 000 levels deep crashes the process, every decode refuses it."""
    code = textwrap.dedent(
        """
        import sys, threading
        sys.path.insert(0, TESTS)
        import hostile
        from graphlane.protocol import OPS, wire
        deep = hostile.Packed(hostile.nested(100_000), "deep")
        messages = [
            [hostile.pack({"v": 1, "id": 7, "op": "status", "body": deep})],
            [hostile.pack({"id": 7, "v": deep, "op": "status", "body": {}})],
            [hostile.pack({"v": 1, "id": 7, "ok": True, "body": deep})],
            [hostile.pack([deep])],
        ]
        def run():
            for frames in messages:
                for decode in (wire.decode_requests, wire.decode_replies):
                    for item in decode(frames):
                        if isinstance(item, wire.Reply):
                            try:
                                item.body(OPS["status"])
                            except wire.DecodeError:
                                pass
            print("survived")
        threading.stack_size(64 * 1024)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        """
    )
    code = code.replace("TESTS", repr(str(Path(__file__).parents[1])))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "survived" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize(
    "value",
    [
        b"\xdd\x00\x01\x11\x71" + b"\x01" * 70001,
        b"\xdf\x00\x01\x11\x71" + b"\x01\x01" * 70001,
        b"\xdf\xff\xff\xff\xff\xa1k",  # declares 2**32-1 entries, holds one
    ],
    ids=["array", "map", "declared"],
)
def test_wide_values_are_refused_before_anything_is_built(value: bytes) -> None:
    frames = [hostile.pack({"v": 1, "id": 7, "op": "status", "body": hostile.Packed(value, "")})]
    for decode in (decode_requests,):
        (refusal,) = decode(frames)
        assert isinstance(refusal, DecodeError)
        assert (refusal.code, refusal.request_id) == (ErrorCode.BAD_REQUEST, 7)


@pytest.mark.parametrize("what", ["envelope", "frames", "message"])
def test_a_message_over_a_size_limit_is_too_large_naming_its_id(what: str) -> None:
    limits = Limits(max_envelope_bytes=4096, max_frames=4, max_message_bytes=8192)
    step = ops.Step("attention", 0, {"actual_seq_lengths_kv": [1] * 2000})  # ~2 KiB
    frames: list[Any] = [bytes(frame) for frame in encode_request(9, "step", step)]
    if what == "envelope":
        step = ops.Step("attention", 0, {"actual_seq_lengths_kv": [1] * 5000})
        frames = [bytes(frame) for frame in encode_request(9, "step", step)]
    elif what == "frames":
        frames += [b"x"] * 4
    else:
        frames.append(bytes(8192))
    for decode in (decode_requests,):
        with pytest.raises(DecodeError) as info:
            decode(frames, limits)
        assert (info.value.code, info.value.request_id) == (ErrorCode.TOO_LARGE, 9)
    with pytest.raises(TooLarge):  # what a sender checks before sending
        check_outgoing(frames, limits)
    assert not TooLarge("x").retryable


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((max(_depth(k), _depth(v)) for k, v in value.items()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


@FUZZ
@given(values, st.integers(8, 12), st.binary(max_size=4))
def test_the_walk_finds_a_values_end_and_depth(value: Any, depth: int, after: bytes) -> None:
    """The walk agrees with msgpack: where a value ends, how deep it nests."""
    limits = Limits(max_depth=depth)
    data = msgpack.packb(value, use_bin_type=True)
    end, problem = walk(data + after, 0, limits)
    assert end == len(data)
    assert (problem is not None) == (_depth(value) > depth), (problem, _depth(value))
    assert walk(data[:-1], 0, limits)[0] is None  # cut short: no end
