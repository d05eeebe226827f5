"""Hostile messages, structure-aware: what a client that means harm sends to a socket.

Strategies (hypothesis) for the decoders' fuzzing (tests/protocol/test_fuzz.py) and the
sockets' (tests/daemon/test_hostile.py): envelopes of every op whose fields are each
plausible or wrong (a wrong type, a value out of bounds, nested hundreds of levels deep,
an array or map of more entries than allowed or declaring more than it holds), their keys
in any order (``op`` last makes msgspec skip what comes before it), tensor references
with frames truncated, extended, missing or extra, garbage frames, bundles of all these.

Nothing here stops or drains a server: ``drain`` and ``shutdown`` always carry an
unknown field, so they are refused (the sockets' fuzzing shares a daemon with others).
"""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import strategies as st

from graphlane.protocol import OPS, TENSOR_KEY

DESTRUCTIVE = ("drain", "shutdown")


class Packed:
    """Bytes put into a message as they are: a value msgpack would refuse to pack (nested
    too deep) or could not express (a header declaring more than follows)."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.what = what

    def __repr__(self) -> str:
        return f"Packed({self.what})"


def pack(value: Any) -> bytes:
    """``value`` as msgpack, each :class:`Packed` in it replaced by its bytes."""
    holes: list[bytes] = []

    def marker(i: int) -> msgpack.ExtType:
        return msgpack.ExtType(99, b"\x00hole%08d\x00" % i)

    def default(obj: Any) -> Any:
        if isinstance(obj, Packed):
            holes.append(obj.data)
            return marker(len(holes) - 1)
        raise TypeError(f"cannot pack {type(obj).__name__}")

    out = msgpack.packb(value, default=default, use_bin_type=True)
    for i, data in enumerate(holes):
        out = out.replace(msgpack.packb(marker(i)), data, 1)
    return out


def nested(depth: int, leaf: bytes = b"\x00", container: bytes = b"\x91") -> bytes:
    """A value ``depth`` levels deep: ``[[[...0...]]]`` (or maps: ``b"\\x81\\xa1k"``)."""
    return container * depth + leaf


# ------------------------------------------------------------------------ hostile values
deep = st.builds(
    lambda depth, kind: Packed(
        nested(depth, container=b"\x91" if kind else b"\x81\xa1k"), f"{depth} deep"
    ),
    st.sampled_from([33, 64, 999, 1000, 5000]),
    st.booleans(),
)
wide = st.sampled_from(
    [
        Packed(b"\xdc\x10\x01" + b"\x00" * 0x1001, "array of 4097"),
        Packed(b"\xdd\x00\x01\x11\x71" + b"\x01" * 70001, "array of 70001"),
        Packed(b"\xde\x10\x01" + b"\xa1k\x00" * 0x1001, "map of 4097 (repeated keys)"),
        Packed(b"\xdd\xff\xff\xff\xff\x00", "array declaring 2**32-1"),
        Packed(b"\xdf\xff\xff\xff\xff\xa1k", "map declaring 2**32-1"),
        Packed(b"\xdb\xff\xff\xff\xffabc", "str declaring 2**32-1 bytes"),
        Packed(b"\xc6\x7f\xff\xff\xff\x00", "bin declaring 2**31-1 bytes"),
        Packed(b"\xc9\xff\xff\xff\xff\x05", "ext declaring 2**32-1 bytes"),
        Packed(b"\xc1", "the byte msgpack never uses"),
    ]
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=200)
    | st.binary(max_size=64)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
)
wrong = st.recursive(
    scalars | deep | wide,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=8,
)

# --------------------------------------------------------------------- plausible values
sizes = st.integers(0, 4)


@st.composite
def tensor_refs(draw: st.DrawFn, frames: list[bytes]) -> dict[str, Any]:
    """A ``$tensor`` reference; when it names a frame, the frame is appended to ``frames``
    with as many bytes as the shape needs, or a few more or fewer."""
    dtype = draw(st.sampled_from(["float16", "int64", "int32", "bool", "bfloat16", "float32"]))
    shape = draw(st.lists(st.integers(0, 6), max_size=3))
    itemsize = {"float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1, "float32": 4}
    nbytes = itemsize[dtype]
    for d in shape:
        nbytes *= d
    nbytes = max(0, nbytes + draw(st.sampled_from([0, 0, 0, -1, 1, 7, -nbytes])))
    spec: dict[str, Any] = {"dtype": dtype, "shape": shape}
    if draw(st.booleans()):
        spec["data"] = bytes(nbytes) if dtype != "bool" else b"\x01" * nbytes
    else:
        frames.append(draw(st.sampled_from([b"\x00", b"\x01", b"\x07"])) * nbytes)
        spec["frame"] = draw(st.sampled_from([len(frames), len(frames), 0, len(frames) + 1]))
    return {TENSOR_KEY: spec}


def plausible(field: str, frames: list[bytes]) -> st.SearchStrategy[Any]:
    """A value of the field's type that may well be accepted."""
    lengths = st.lists(st.integers(1, 32), min_size=1, max_size=4)
    return {
        "program": st.sampled_from(["attention", "nope"]),
        "device": st.sampled_from([0, 0, 1]),
        "batch": st.integers(1, 4),
        "params": st.fixed_dictionaries({"actual_seq_lengths_kv": lengths}),
        "inputs": st.dictionaries(
            st.sampled_from(["query", "key"]), tensor_refs(frames), max_size=2
        ),
        "outputs": st.sampled_from([["out"], ["out", "lse"], []]),
        "timeout_ms": st.sampled_from([1000, 5000]),
        "generation": st.sampled_from([0, 1]),
        "slots": tensor_refs(frames),
        "key": tensor_refs(frames),
        "value": tensor_refs(frames),
        "client": st.text(max_size=10),
    }.get(field, scalars)


# ------------------------------------------------------------------------------ messages
@st.composite
def envelopes(draw: st.DrawFn, frames: list[bytes], ops: tuple[str, ...]) -> dict[str, Any]:
    """A request envelope of one of ``ops``, each field plausible or wrong, keys in any
    order, maybe one key too many or one missing."""
    op = draw(st.sampled_from(ops))
    body: dict[str, Any] = {}
    for field in OPS[op].request.__struct_fields__:
        if draw(st.integers(0, 5)) == 0:
            continue  # left out
        body[field] = draw(wrong if draw(st.integers(0, 3)) == 0 else plausible(field, frames))
    if draw(st.integers(0, 7)) == 0:
        body["fuzz"] = draw(wrong)  # an unknown field
    env: dict[str, Any] = {
        "v": draw(st.just(1) | wrong) if draw(st.integers(0, 7)) == 0 else 1,
        "id": draw(st.integers(0, 2**64 - 1) | wrong) if draw(st.integers(0, 7)) == 0 else None,
        "op": draw(wrong) if draw(st.integers(0, 9)) == 0 else op,
        "body": draw(wrong) if draw(st.integers(0, 9)) == 0 else body,
    }
    if env["id"] is None:
        env["id"] = draw(st.integers(0, 2**32))
    if env["op"] in DESTRUCTIVE:  # whatever was drawn: a body the op refuses
        env["body"] = {**(env["body"] if isinstance(env["body"], dict) else {}), "fuzz": 0}
    if draw(st.integers(0, 9)) == 0:
        env["extra"] = draw(wrong)
    order = draw(st.permutations(list(env)))
    return {key: env[key] for key in order}


@st.composite
def messages(draw: st.DrawFn, ops: tuple[str, ...] = tuple(OPS)) -> list[bytes]:
    """The frames of one hostile message: an envelope or a bundle, its data frames, then
    maybe truncated, extended, reordered, dropped, duplicated or garbage frames."""
    frames: list[bytes] = []
    if draw(st.integers(0, 4)) == 0:
        items = draw(st.lists(envelopes([], ops) | wrong, min_size=1, max_size=4))
        head = pack(items)  # a bundle (none of its envelopes may reference a frame)
    else:
        head = pack(draw(envelopes(frames, ops) | wrong))
    out = [head, *frames]
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["truncate", "extend", "garbage", "drop", "dup", "swap"]))
        i = draw(st.integers(0, len(out) - 1))
        if kind == "truncate":
            out[i] = out[i][: draw(st.integers(0, max(0, len(out[i]) - 1)))]
        elif kind == "extend":
            out[i] = out[i] + draw(st.binary(min_size=1, max_size=16))
        elif kind == "garbage":
            out.insert(i, draw(st.binary(max_size=64)))
        elif kind == "drop" and len(out) > 1:
            del out[i]
        elif kind == "dup":
            out.insert(i, out[i])
        elif kind == "swap" and len(out) > 1:
            j = draw(st.integers(0, len(out) - 1))
            out[i], out[j] = out[j], out[i]
    return out


# ------------------------------------------------------------------ frame counts and sizes
@st.composite
def frame_bombs(draw: st.DrawFn, max_frames: int = 64) -> list[bytes]:
    """A hostile message padded with frames: around the frame limit (one under, at, one
    over), far over it (thousands, empty or not), or frames larger than a small message
    allows; the frames may follow a plausible envelope, a bundle, or garbage."""
    head = draw(messages())
    count = draw(
        st.sampled_from([max_frames - 1 - len(head), max_frames - len(head), max_frames + 1])
        | st.integers(max_frames + 2, 5000)
    )
    size = draw(st.sampled_from([0, 0, 1, 64, 4096]))
    return [*head, *[b"\x07" * size] * max(0, count)]
