"""Where a program plugs into the load test: what its calls carry and how its answers are
checked, made from the program's entry in the daemon's ``hello``.

The rule that picks the shape of the load comes from that entry alone:

* a program with **no device state** (``state_ops`` empty): each step stands alone, so
  steps are independent calls, any number in flight (:mod:`.calls`). Its workload is a
  :class:`CallWorkload`;
* a program with **device state** (``state_ops``; ``state`` says its kind): a step
  reads what earlier operations wrote for its rows, so the rows are *sequences* that
  live on one device, and one scheduler per device runs them as a decode loop does:
  sequences arrive, their state is written, continuously batched steps advance them
  one token each, one step in flight per device (:mod:`.batching`). The per-row
  inputs that address that state (a block table, a slot mapping) come from the
  scheduler's own bookkeeping of it. Its workload is a :class:`SequenceWorkload` per
  device, for the state's kind.

Adding a program is one class and one entry in :mod:`.driver`'s table: a
:class:`CallWorkload` for a stateless program, or a :class:`SequenceWorkload` for a
kind of device state (a model whose decode loop keeps a paged KV cache reuses the
paged bookkeeping and brings its own inputs and reference).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from graphlane.client import Client, StepReply

#: Tolerances (atol = rtol) of a checked output, by its dtype.
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 6e-2, torch.float32: 1e-4}


def close_to(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> float | None:
    """The max |out - expected|, or None when ``out`` is wrong (shape or tolerance)."""
    if tuple(out.shape) != tuple(expected.shape):
        return None
    tol = TOLERANCE.get(dtype, 1e-2)
    got, want = out.float(), expected.float()
    err = float((got - want).abs().max()) if got.numel() else 0.0
    if not torch.allclose(got, want, rtol=tol, atol=tol) or not math.isfinite(err):
        return None
    return err


class LoadTestError(RuntimeError):
    """The load test cannot run against this daemon (program, shapes, devices ...)."""


@dataclass(frozen=True)
class Call:
    """One step request the load test sends: where, how many rows, what it carries, and
    what its answer is checked against (``expected``; None: not checked)."""

    device: int
    batch: int
    params: dict[str, Any]
    inputs: dict[str, torch.Tensor]
    expected: torch.Tensor | None = None
    #: the sequences of the rows, for a stateful program (row order)
    rows: tuple[int, ...] = field(default=())


class CallWorkload(Protocol):
    """A stateless program's calls."""

    #: devices and batch sizes drawn from, and every setting the calls were built with
    devices: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    buckets: tuple[int, ...]
    #: the output every call asks for and checks
    output: str

    def draw(self, rng: random.Random) -> Call:
        """The next call (a share of them with ``expected`` set)."""
        ...

    def probe(self, device: int) -> Call:
        """A checked call of the smallest batch, sent once per device before the run."""
        ...

    def check(self, call: Call, out: torch.Tensor) -> float | None:
        """The max |out - expected|, or None when ``out`` is wrong (shape or tolerance)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the report shows of it: ``shape``, ``shape_from`` ("hello", or the flag
        that gave it) and ``tolerance``."""
        ...


class SequenceWorkload(Protocol):
    """One device's scheduler of a stateful program: its live sequences and the host copy
    of their state, from which it builds their steps and their expected outputs."""

    #: the output every step asks for and checks
    output: str
    #: live sequences by id
    seqs: dict[int, Any]

    @property
    def max_batch(self) -> int:
        """The most rows a step can carry (the largest bucket)."""
        ...

    @property
    def max_len(self) -> int:
        """The longest a sequence may get (prompt + decoded tokens)."""
        ...

    def admit(self, sid: int, prompt: int, decode: int) -> Any | None:
        """A new sequence with its share of the state reserved, or None (no room now)."""
        ...

    async def write(self, client: Client, program: str, device: int, sid: int) -> int:
        """Write what the device must hold of sequence ``sid`` (after admission, or again
        after its state was lost); returns the worker generation that holds it."""
        ...

    def step(self, sids: list[int], device: int, check: bool) -> Call:
        """The next step of the sequences ``sids`` (``expected`` set when ``check``)."""
        ...

    def advance(self, call: Call) -> list[int]:
        """Commit a step that succeeded; the sequences it finished."""
        ...

    def generation_of(self, sid: int) -> int | None:
        """The worker generation sequence ``sid``'s state was written in (None: not yet,
        or lost)."""
        ...

    def forget_state(self) -> None:
        """The device's state is gone: no sequence's state is held any more."""
        ...

    def end(self, sid: int) -> None:
        """Sequence ``sid`` is done (finished or cut): release its share of the state."""
        ...

    def bucket_for(self, batch: int) -> int:
        """The captured bucket a step of ``batch`` rows runs in."""
        ...

    def check(self, call: Call, reply: StepReply) -> float | None:
        """The max |out - expected|, or None when the output is wrong."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counts of its own for the report (e.g. blocks reused)."""
        ...
