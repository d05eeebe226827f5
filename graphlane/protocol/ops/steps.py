"""Device operations, answered by the device's worker: ``step``, ``update``, ``replay``.

A step patches a program's captured graph with ``params``, copies ``inputs``
into its static buffers, replays it and returns the requested ``outputs``.
``update`` patches the next replay only; ``replay`` replays as last patched.

``generation``: the worker generation the request expects (see the package docstring);
required for a program with device state, refused with STATE_LOST when it is not the
worker's.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from graphlane.protocol.bounds import MAX_ITEMS, Count, Name, Positive
from graphlane.protocol.tensors import Tensor, TensorData, take_tensors

MAX_OUTPUTS = 16
MAX_PARAMS = 64

Number = int | float
Param = None | bool | int | float | str | Annotated[list[Number], Meta(max_length=MAX_ITEMS)]
Params = Annotated[dict[Name, Param], Meta(max_length=MAX_PARAMS)]
Tensors = Annotated[dict[Name, Tensor], Meta(max_length=MAX_PARAMS)]
Outputs = Annotated[list[Name], Meta(max_length=MAX_OUTPUTS)]
Deadline = Annotated[int, Meta(ge=1)]


class Step(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Patch, copy inputs, replay, answer outputs. ``batch`` defaults to what the
    program reads from its params; ``timeout_ms``: a step still unissued that long
    after the worker received it is answered TIMEOUT without running."""

    program: Name
    device: Count
    params: Params = {}
    inputs: Tensors = {}
    outputs: Outputs = []
    batch: Positive | None = None
    timeout_ms: Deadline | None = None
    generation: Count | None = None

    def __post_init__(self) -> None:
        if self.inputs:
            take_tensors(self.inputs)


class Update(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Patch the next replay of the batch's bucket (no replay, no outputs)."""

    program: Name
    device: Count
    params: Params = {}
    inputs: Tensors = {}
    batch: Positive | None = None
    timeout_ms: Deadline | None = None
    generation: Count | None = None

    def __post_init__(self) -> None:
        if self.inputs:
            take_tensors(self.inputs)


class Replay(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Replay the bucket's graph instance as last patched."""

    program: Name
    device: Count
    batch: Positive
    outputs: Outputs = []
    timeout_ms: Deadline | None = None
    generation: Count | None = None


class DeviceResult(Struct, frozen=True, omit_defaults=True):
    """The reply body of step, update, replay, kv_write and kv_read. Fields a newer server adds are
    skipped, not refused (reply bodies may grow: see the package docstring)."""

    outputs: dict[Name, Tensor] = {}
    bucket: Count = 0
    instance: Count = 0  # which graph instance of the bucket's ring ran it
    patched: Count = 0  # task groups patched
    server_us: float = 0.0  # time the worker held the request, device work included
    generation: Count = 0  # the answering worker's generation (unique per daemon start)

    def __post_init__(self) -> None:
        if self.outputs:
            take_tensors(self.outputs)


class DeviceValues(Struct, frozen=True, omit_defaults=True):
    """:class:`DeviceResult` as a reply read for its outputs' values (the client's
    ``decode(as_lists=True)``): the same fields, its outputs' references read as they
    are, each then made the list of its values (``wire.Reply.body``). A test keeps the
    two alike."""

    outputs: dict[Name, TensorData] = {}
    bucket: Count = 0
    instance: Count = 0
    patched: Count = 0
    server_us: float = 0.0
    generation: Count = 0
