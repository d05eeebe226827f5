"""Sequence operations: a model program's decoding sequences, kept by the worker.

``add`` runs one sequence's prompt into the KV cache blocks it names and keeps the
sequence on the worker (its blocks, its length, its sampling settings, its last sampled
token on the device); ``decode`` advances sequences by one token each, fed the token
each sampled last (no token, no length, no block table on the wire: a decode's bytes do
not grow with the context or the table width); ``append_blocks`` gives a sequence more
blocks (also a field of ``decode``); ``free`` forgets sequences. A sequence is the
client's that added it (its CURVE key, else its connection): no other client can name
it. docs/models.md, "Sequences", has the rules. ``add`` and ``decode`` answer a
:class:`~graphlane.protocol.ops.steps.DeviceResult` (``tokens`` [1] / [rows] sampled);
``append_blocks`` and ``free`` answer at once, in order with the requests before them.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from graphlane.protocol.bounds import MAX_ITEMS, Count, Name
from graphlane.protocol.ops.steps import Deadline, Outputs, Params
from graphlane.protocol.tensors import Tensor, take_tensor

MAX_SEQUENCE_ID = 2**62  # the largest id a client may give a sequence
SequenceId = Annotated[int, Meta(ge=0, le=MAX_SEQUENCE_ID)]
Sequences = Annotated[list[SequenceId], Meta(min_length=1, max_length=MAX_ITEMS)]
Blocks = Annotated[list[Count], Meta(max_length=MAX_ITEMS)]
NewBlocks = Annotated[dict[SequenceId, Blocks], Meta(max_length=MAX_ITEMS)]


class AddSequence(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Prefill ``tokens`` [n] into ``blocks`` and keep the sequence as ``sequence``."""

    program: Name
    device: Count
    sequence: SequenceId
    tokens: Tensor
    blocks: Blocks
    params: Params = {}  # temperature, top_k, top_p, seed: the sequence's, kept
    outputs: Outputs = []
    generation: Count | None = None
    timeout_ms: Deadline | None = None

    def __post_init__(self) -> None:
        take_tensor(self, "tokens")


class Decode(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One token more for each of ``sequences`` (one row each, in this order)."""

    program: Name
    device: Count
    sequences: Sequences
    new_blocks: NewBlocks = {}  # appended to those sequences' blocks first
    outputs: Outputs = []
    generation: Count | None = None
    timeout_ms: Deadline | None = None


class AppendBlocks(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Append ``blocks`` to ``sequence``'s block list."""

    program: Name
    device: Count
    sequence: SequenceId
    blocks: Blocks
    generation: Count | None = None


class Free(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Forget ``sequences`` (their blocks are the client's to reuse)."""

    program: Name
    device: Count
    sequences: Sequences
    generation: Count | None = None


__all__ = ["MAX_SEQUENCE_ID", "AddSequence", "AppendBlocks", "Decode", "Free"]
