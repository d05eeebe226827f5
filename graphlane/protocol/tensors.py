"""Tensors on the wire: ``{"$tensor": {"dtype", "shape", "frame" | "data"}}``.

A tensor travels as a frame of its own (decoded as a view of the received buffer,
no copy) or, at most ``INLINE_TENSOR_BYTES``, as inline bytes in the envelope.
:func:`tensor_ref` makes one for sending (the codec's encoder writes the same map
for each tensor it meets, :func:`encoded_ref`, :mod:`graphlane.protocol.wire`). A
body's tensor fields are typed :data:`Tensor`: on the wire a :class:`TensorRef`,
which msgspec reads and checks like any other field and which turns itself into a
``torch.Tensor`` over the message's frames as it is decoded
(:meth:`TensorRef.__post_init__`, in the same pass as the rest of the message; the
frames are those the codec is reading, see :func:`read`); the body then
holds tensors (:func:`take_tensors`).

torch is imported when a tensor is first made or sent, not with this module: a process
that passes no tensors (the daemon) does without it.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, get_args

import msgspec
import numpy as np
from msgspec import Meta, Struct

from graphlane.protocol.admission import Limits
from graphlane.protocol.bounds import Count, Positive

if TYPE_CHECKING:
    import torch

Frame: TypeAlias = bytes | memoryview
"""A frame as the encoder makes it: the envelope's bytes, a view of a tensor's memory."""

INLINE_TENSOR_BYTES = 1024
"""Tensors of at most this many bytes travel inside the envelope, larger ones as frames."""
TENSOR_KEY = "$tensor"

DType = Literal[
    "float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool"
]
WIRE_DTYPE_NAMES: tuple[str, ...] = get_args(DType)
"""The dtypes a tensor may have on the wire, by their wire name (torch's names)."""
#: memoryview's format of each wire dtype it can read (none for float16 and bfloat16)
_FORMATS = {"float32": "f", "float64": "d", "int8": "b", "uint8": "B", "int16": "h",
            "int32": "i", "int64": "q", "bool": "?"}  # fmt: skip
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
             "int16": 2, "int32": 4, "int64": 8, "bool": 1}  # fmt: skip


@functools.cache
def _dtypes() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str], dict[torch.dtype, Any]]:
    """WIRE_DTYPES, DTYPE_NAMES and the numpy dtypes, made when first needed."""
    import torch

    wire = {name: getattr(torch, name) for name in WIRE_DTYPE_NAMES}
    numpy = {wire[n]: getattr(np, "bool_" if n == "bool" else n) for n in wire if n != "bfloat16"}
    return wire, {dtype: name for name, dtype in wire.items()}, numpy


@functools.cache
def _numpy_names() -> dict[Any, str]:
    """The wire name of each numpy dtype a wire dtype has (all but bfloat16)."""
    return {np.dtype(numpy): _dtypes()[1][dtype] for dtype, numpy in _dtypes()[2].items()}


def __getattr__(name: str) -> Any:  # WIRE_DTYPES, DTYPE_NAMES: with torch, when asked for
    if name == "WIRE_DTYPES":
        return _dtypes()[0]
    if name == "DTYPE_NAMES":
        return _dtypes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TensorSpec(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    dtype: DType
    shape: Annotated[list[Count], Meta(max_length=8)]
    frame: Positive | None = None
    data: bytes | None = None


class TensorRef(Struct, forbid_unknown_fields=True, dict=True):
    """A tensor in a body: ``{"$tensor": {...}}``. Decoded, it is checked and made a
    tensor over the frames of the message being read (``tensor``), in the decoder's
    pass: a reference that does not fit its frames fails there, and msgspec names the
    field it is in."""

    spec: TensorSpec = msgspec.field(name=TENSOR_KEY)

    def __post_init__(self) -> None:
        frames: Frames | None = getattr(_reading, "frames", None)
        if frames is None:  # made by a sender (tensor_ref), not read from a message
            return
        try:
            if _reading.lists:  # its values as lists (Reply.body's ``lists``)
                self.tensor = frames.values(self.spec)
            else:
                self.tensor = frames.tensor(self.spec)  # (None: checked, not made)
        except ValueError as exc:  # msgspec names the field the reference is in
            raise ValueError(f".{TENSOR_KEY}: {exc}") from None


class TensorData(Struct, forbid_unknown_fields=True):
    """A tensor reference read as it is: its spec, checked as a :class:`TensorRef`'s is
    (in C), and nothing made. A reply read for its values (``Reply.body``'s ``lists``)
    reads its references so, then each one's values (:meth:`Frames.values`), without a
    call back into Python per reference as it is decoded."""

    spec: TensorSpec = msgspec.field(name=TENSOR_KEY)


def tensor_ref(t: torch.Tensor, frames: list[Frame], *, path: str = "tensor") -> TensorRef:
    """The reference of a CPU tensor to send; a large one's bytes are appended to
    ``frames`` as a view of its memory (a non-contiguous tensor is copied first)."""
    return TensorRef(TensorSpec(**encoded_ref(t, frames, path=path)[TENSOR_KEY]))


def encoded_ref(t: torch.Tensor, frames: list[Frame], *, path: str = "tensor") -> dict[str, Any]:
    """:func:`tensor_ref` as the encoder writes it: the same map, made as plain dicts
    (the codec's encoder hook calls it for every tensor it meets; it encodes to the
    bytes of the :class:`TensorRef`, without making one: no Struct, no ``__post_init__``)."""
    import torch

    if type(t) is torch.Tensor:
        # The common tensor (a worker's sampled tokens, a step's lengths): small, on the
        # CPU. Its numpy view refuses every tensor the checks below refuse or change (not
        # on the CPU, not strided, needing grad, conjugate or negative bits, bfloat16),
        # and reads its dtype, shape and bytes for a third of the torch calls.
        try:
            a = t.numpy()
        except (TypeError, RuntimeError, ValueError):
            pass
        else:
            name = _numpy_names().get(a.dtype)
            if name is not None and a.nbytes <= INLINE_TENSOR_BYTES:
                return {TENSOR_KEY: {"dtype": name, "shape": list(a.shape), "data": a.tobytes()}}
    if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
        raise ValueError(f"{path}: must be a tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{path}: tensor is on {t.device}; copy it to the CPU before sending")
    if t.layout != torch.strided:
        raise ValueError(f"{path}: {t.layout} tensors cannot be sent, only strided ones")
    name = _dtypes()[1].get(t.dtype)
    if name is None:
        raise ValueError(
            f"{path}: dtype {t.dtype} cannot be sent (supported: {sorted(WIRE_DTYPE_NAMES)})"
        )
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
        return {TENSOR_KEY: {"dtype": name, "shape": shape, "data": data}}
    frames.append(_byte_view(t))
    return {TENSOR_KEY: {"dtype": name, "shape": shape, "frame": len(frames)}}


def _byte_view(t: torch.Tensor) -> memoryview:
    """A flat byte memoryview over a contiguous CPU tensor's memory (shares it)."""
    import torch

    return t.reshape(-1).view(torch.uint8).numpy().data


class Frames:
    """The data frames of one received message; hands each out once, as a tensor
    (``make``: False checks each reference against its frame and makes none, for a
    process without torch: the daemon, which refuses tensors)."""

    __slots__ = ("_frames", "_used", "limits", "make")

    def __init__(self, frames: Sequence[memoryview], limits: Limits, make: bool = True) -> None:
        self._frames = frames
        self._used = 0
        self.limits = limits
        self.make = make

    def tensor(self, spec: TensorSpec) -> torch.Tensor | None:
        """The tensor ``spec`` describes, over its frame (each frame is handed out
        once) or its inline bytes; ValueError if it does not fit them or the limits."""
        buf = self._bytes(spec)
        if not self.make:
            return None
        return _tensor_of(buf, _dtypes()[0][spec.dtype], spec.shape, inline=spec.data is not None)

    def values(self, spec: TensorSpec) -> Any:
        """What :meth:`tensor` would make, as its ``tolist()``: Python numbers in lists
        nested by the shape, read from the bytes without a tensor (but for float16,
        bfloat16 and empty ones, whose values go through one)."""
        buf = self._bytes(spec)
        fmt = _FORMATS.get(spec.dtype)
        shape = spec.shape
        if fmt is None or not all(shape):
            return _tensor_of(
                buf, _dtypes()[0][spec.dtype], shape, inline=spec.data is not None
            ).tolist()
        view = memoryview(buf)
        if fmt == "?" and bytes(view).translate(None, b"\x00\x01"):
            raise ValueError("bool tensor bytes must be 0 or 1")
        return view.cast("B").cast(fmt, shape).tolist()  # type: ignore[call-overload]

    def _bytes(self, spec: TensorSpec) -> Any:
        """The bytes ``spec`` refers to, checked against it and the limits."""
        shape, data = spec.shape, spec.data
        # The common reference (a decode's tokens, a step's lengths: short, 1-D, inline):
        # the checks below, in a few operations.
        if (
            data is not None
            and spec.frame is None
            and len(shape) == 1
            and len(data) == shape[0] * _ITEMSIZE[spec.dtype] <= self.limits.max_tensor_bytes
        ):
            return data
        if len(shape) > self.limits.max_tensor_dims:
            raise ValueError(f"{len(shape)} dimensions, at most {self.limits.max_tensor_dims}")
        itemsize = _ITEMSIZE[spec.dtype]
        count = math.prod(shape)
        nbytes = count * itemsize
        # Zero-sized dimensions count as one: an empty tensor whose other dimensions
        # are huge would overflow torch's stride computation.
        limit = self.limits.max_tensor_bytes
        if nbytes > limit or (not count and math.prod(d or 1 for d in shape) * itemsize > limit):
            raise ValueError(f"shape {shape} of {spec.dtype} is over {limit} bytes")
        if (spec.frame is None) == (spec.data is None):
            raise ValueError("exactly one of $tensor.frame and $tensor.data")
        if spec.data is not None:
            buf: Any = spec.data
        else:
            index = spec.frame
            assert index is not None
            if index > len(self._frames):
                raise ValueError(f"frame {index} does not exist ({len(self._frames)} sent)")
            bit = 1 << index
            if self._used & bit:
                raise ValueError(f"frame {index} is referenced twice")
            self._used |= bit
            buf = self._frames[index - 1]
        if len(buf) != nbytes:
            raise ValueError(f"{len(buf)} bytes for shape {shape} of {spec.dtype}")
        return buf

    @property
    def count(self) -> int:
        return len(self._frames)

    def check_all_used(self) -> None:
        if self._used != (1 << (len(self._frames) + 1)) - 2:
            unused = [i + 1 for i in range(len(self._frames)) if not self._used & (1 << (i + 1))]
            raise ValueError(f"frames {unused} are referenced by no tensor")


def _tensor_of(buf: Any, dtype: torch.dtype, shape: list[int], *, inline: bool) -> torch.Tensor:
    """A tensor over ``buf``: a view of a received frame, a small copy of inline bytes."""
    import torch

    if not len(buf):
        return torch.empty(shape, dtype=dtype)
    if inline and len(shape) == 1 and dtype is not torch.bool:
        # A 1-D one (a step's tokens, lengths; a decode's reply): torch's own view of a
        # fresh bytearray, one call (1.4 us against numpy's 1.8).
        return torch.frombuffer(bytearray(buf), dtype=dtype)
    if inline and dtype is not torch.bfloat16:
        # A small copy of its own, writable and aligned: numpy's view of a fresh
        # bytearray is the cheapest way to a small tensor.
        array = np.ndarray(shape, _dtypes()[2][dtype], bytearray(buf))
        if dtype is torch.bool and bool((array.view(np.uint8) > 1).any()):
            raise ValueError("bool tensor bytes must be 0 or 1")
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
        raise ValueError("bool tensor bytes must be 0 or 1")
    return flat.view(dtype).reshape(shape)


# ------------------------------------------------------------------ tensor fields
if TYPE_CHECKING:
    Tensor: TypeAlias = torch.Tensor
else:
    Tensor = TensorRef
# A tensor field of a body: on the wire a TensorRef, decoded and checked by msgspec
# like any other field (in C, with the field's path in its errors); in Python a
# torch.Tensor: the body's __post_init__ takes each reference's tensor (take_tensors),
# and the encoder's hook turns each tensor into a reference.

_reading = threading.local()


def read(
    decoder: msgspec.msgpack.Decoder[Any], raw: Any, frames: Frames, lists: bool = False
) -> Any:
    """``raw`` decoded by ``decoder``, each tensor reference in it made over ``frames``
    (with ``lists``, its values as lists: :meth:`Frames.values`), and every frame used
    by one (the codec's read of every request and reply body). Raises what the decoder
    raises, or ValueError for a frame no reference used."""
    _reading.frames = frames
    _reading.lists = lists
    try:
        body = decoder.decode(raw)
    finally:
        _reading.frames = None
        _reading.lists = False
    frames.check_all_used()
    return body


def take_tensors(tensors: dict[str, Any]) -> None:
    """Replace, in place, each decoded reference of a dict of tensors by its tensor
    (a body's ``__post_init__``; values that are tensors already, a sender's, stay)."""
    for name, value in tensors.items():
        if type(value) is TensorRef:
            tensors[name] = _tensor_or_fail(value)


def take_tensor(body: Struct, name: str) -> None:
    """Replace a decoded reference in field ``name`` of ``body`` by its tensor."""
    value = getattr(body, name)
    if type(value) is TensorRef:
        msgspec.structs.force_setattr(body, name, _tensor_or_fail(value))


def _tensor_or_fail(ref: TensorRef) -> Any:
    if "tensor" not in ref.__dict__:  # made outside a codec's read: it names no frames
        raise ValueError("a tensor reference outside a message being decoded")
    tensor = ref.__dict__["tensor"]
    if tensor is None:  # read by a codec that makes no tensors: the checked reference
        return ref
    return tensor
