"""Tensors on the wire: ``{"$tensor": {"dtype", "shape", "frame" | "data"}}``.

A tensor travels as a frame of its own (decoded as a view of the received buffer,
no copy) or, at most ``INLINE_TENSOR_BYTES``, as inline bytes in the envelope.
:func:`tensor_ref` makes one for sending, :meth:`Frames.tensor` turns one back
into a ``torch.Tensor`` (checking the frame index, that each frame is used once,
and the byte count). A body's tensor fields are typed :data:`Tensor`:
:func:`body_decoder` notes them, :func:`with_tensors` makes their references
tensors over the message's frames. Envelopes and messages are in
:mod:`graphlane.protocol.wire`.
"""

from __future__ import annotations

import ctypes
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, TypeVar

import msgspec
import msgspec.inspect
import numpy as np
import torch
from msgspec import Meta, Struct

from graphlane.protocol.bounds import Count, Positive

if TYPE_CHECKING:
    from graphlane.protocol.wire import Frame, Limits

INLINE_TENSOR_BYTES = 1024
"""Tensors of at most this many bytes travel inside the envelope, larger ones as frames."""
TENSOR_KEY = "$tensor"

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
DType = Literal[
    "float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool"
]

T = TypeVar("T")


class TensorSpec(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    dtype: DType
    shape: Annotated[list[Count], Meta(max_length=8)]
    frame: Positive | None = None
    data: bytes | None = None


class TensorRef(Struct, frozen=True, forbid_unknown_fields=True):
    """A tensor in a body: ``{"$tensor": {...}}``."""

    spec: TensorSpec = msgspec.field(name=TENSOR_KEY)


def tensor_ref(t: torch.Tensor, frames: list[Frame], *, path: str = "tensor") -> TensorRef:
    """The reference of a CPU tensor to send; a large one's bytes are appended to
    ``frames`` as a view of its memory (a non-contiguous tensor is copied first)."""
    if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
        raise ValueError(f"{path}: must be a tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{path}: tensor is on {t.device}; copy it to the CPU before sending")
    if t.layout != torch.strided:
        raise ValueError(f"{path}: {t.layout} tensors cannot be sent, only strided ones")
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"{path}: dtype {t.dtype} cannot be sent (supported: {sorted(DTYPES)})")
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    shape = list(t.shape)
    nbytes = t.nbytes
    if nbytes <= INLINE_TENSOR_BYTES:
        # The bytes of a small contiguous CPU tensor, read at its address: half the
        # cost of numpy's, a fraction of a torch byte view's.
        data = ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b""
        return TensorRef(TensorSpec(name, shape, data=data))  # type: ignore[arg-type]
    frames.append(_byte_view(t))
    return TensorRef(TensorSpec(name, shape, frame=len(frames)))  # type: ignore[arg-type]


def _byte_view(t: torch.Tensor) -> memoryview:
    """A flat byte memoryview over a contiguous CPU tensor's memory (shares it)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


class Frames:
    """The data frames of one received message; hands each out once, as a tensor."""

    __slots__ = ("_frames", "_used", "limits")

    def __init__(self, frames: Sequence[memoryview], limits: Limits) -> None:
        self._frames = frames
        self._used = 0
        self.limits = limits

    def tensor(self, ref: TensorRef, path: str) -> torch.Tensor:
        spec = ref.spec
        shape = spec.shape
        if len(shape) > self.limits.max_tensor_dims:
            raise ValueError(
                f"{path}: {len(shape)} dimensions, at most {self.limits.max_tensor_dims}"
            )
        dtype = DTYPES[spec.dtype]
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        # Zero-sized dimensions count as one: an empty tensor whose other dimensions
        # are huge would overflow torch's stride computation.
        limit = self.limits.max_tensor_bytes
        if (count or math.prod(d or 1 for d in shape)) * dtype.itemsize > limit:
            raise ValueError(f"{path}: shape {shape} of {spec.dtype} is over {limit} bytes")
        if (spec.frame is None) == (spec.data is None):
            raise ValueError(f"{path}: exactly one of $tensor.frame and $tensor.data")
        if spec.data is not None:
            buf: Any = spec.data
        else:
            index = spec.frame
            assert index is not None
            if index > len(self._frames):
                raise ValueError(f"{path}: frame {index} does not exist ({len(self._frames)} sent)")
            bit = 1 << index
            if self._used & bit:
                raise ValueError(f"{path}: frame {index} is referenced twice")
            self._used |= bit
            buf = self._frames[index - 1]
        if len(buf) != nbytes:
            raise ValueError(f"{path}: {len(buf)} bytes for shape {shape} of {spec.dtype}")
        return _tensor_of(buf, dtype, shape, path, inline=spec.data is not None)

    @property
    def count(self) -> int:
        return len(self._frames)

    def fresh(self) -> Frames:
        """The same frames, none handed out yet."""
        return Frames(self._frames, self.limits)

    def check_all_used(self) -> None:
        if self._used != (1 << (len(self._frames) + 1)) - 2:
            unused = [i + 1 for i in range(len(self._frames)) if not self._used & (1 << (i + 1))]
            raise ValueError(f"frames {unused} are referenced by no tensor")


def _tensor_of(
    buf: Any, dtype: torch.dtype, shape: list[int], path: str, *, inline: bool
) -> torch.Tensor:
    """A tensor over ``buf``: a view of a received frame, a small copy of inline bytes."""
    if not len(buf):
        return torch.empty(shape, dtype=dtype)
    if inline and dtype is not torch.bfloat16:
        # A small copy of its own, writable and aligned: numpy's view of a fresh
        # bytearray is the cheapest way to a small tensor.
        array = np.ndarray(shape, _NUMPY[dtype], bytearray(buf))
        if dtype is torch.bool and bool((array.view(np.uint8) > 1).any()):
            raise ValueError(f"{path}: bool tensor bytes must be 0 or 1")
        return torch.from_numpy(array)
    if inline:  # bfloat16: numpy has none; torch reads the bytes
        flat = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    elif memoryview(buf).readonly:
        with warnings.catch_warnings():
            # frombuffer warns that a read-only buffer gives a writable tensor; tensors
            # that view received frames are read-only by contract.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buf, dtype=torch.uint8)
    else:
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    if flat.data_ptr() % dtype.itemsize:
        flat = flat.clone()  # a misaligned frame: an aligned copy is the only safe view
    if dtype is torch.bool and bool((flat > 1).any()):
        raise ValueError(f"{path}: bool tensor bytes must be 0 or 1")
    return flat.view(dtype).reshape(shape)


_NUMPY = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.bool: np.bool_,
}


# ------------------------------------------------------------------ tensor fields
if TYPE_CHECKING:
    Tensor: TypeAlias = torch.Tensor
else:
    Tensor = TensorRef
# A tensor field of a body: on the wire a TensorRef, decoded and checked by msgspec
# like any other field (in C, with the field's path in its errors); in Python a
# torch.Tensor: decode_body turns each reference into a tensor over the message's
# frames, and the encoder's hook turns each tensor into a reference.


# body type -> its tensor fields: (name, True for a dict of tensors)
TENSOR_FIELDS: dict[type, tuple[tuple[str, bool], ...]] = {}


def body_decoder(kind: type[T]) -> msgspec.msgpack.Decoder[T]:
    """The decoder of one body type (bodies may hold :data:`Tensor` fields, plain or
    as the values of a dict)."""
    fields: list[tuple[str, bool]] = []
    info = msgspec.inspect.type_info(kind)
    for f in getattr(info, "fields", ()):
        t = f.type
        if isinstance(t, msgspec.inspect.StructType) and t.cls is TensorRef:
            fields.append((f.name, False))
        elif isinstance(t, msgspec.inspect.DictType):
            v = t.value_type
            if isinstance(v, msgspec.inspect.StructType) and v.cls is TensorRef:
                fields.append((f.name, True))
    if fields:
        TENSOR_FIELDS[kind] = tuple(fields)
    return msgspec.msgpack.Decoder(kind)


def with_tensors(body: Any, fields: tuple[tuple[str, bool], ...], frames: Frames) -> Any:
    """``body`` with its tensor references made tensors over ``frames``."""
    changes: dict[str, Any] = {}
    for name, many in fields:
        value = getattr(body, name)
        if many:
            if value:
                path = f".{name}[...].{TENSOR_KEY}"
                changes[name] = {k: frames.tensor(ref, path) for k, ref in value.items()}
        elif value is not None:
            changes[name] = frames.tensor(value, f".{name}.{TENSOR_KEY}")
    return msgspec.structs.replace(body, **changes) if changes else body
