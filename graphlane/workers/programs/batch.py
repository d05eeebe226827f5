"""The persistent batch of a model program's sequences: what the worker keeps of each
decoding sequence on the device, and how a decode is fed from it.

Each added sequence holds a row of two device tensors, kept for its whole life: its
block-table row (``tables`` int32 [rows, max_blocks_per_seq], the scratch block past
its blocks) and its last sampled token (``last`` int64 [rows]). Row 0 is the padding
rows' (every entry the scratch block, token 0). As vLLM v1's worker keeps its block
tables and last sampled ids on the GPU and gathers a step's rows by an index, a decode:

- writes only what changed in its rows since the device last saw them: a sequence's
  new blocks (its whole row once, when it joins or takes a row another left);
- copies its rows' index (in the decode's order, padded with row 0) with its other
  per-row values, one host tensor in one copy into its instance's buffers, and gathers
  the block-table rows and tokens by it straight into the instance's static buffers
  (device-to-device: one ``index_select(out=)`` each, the feed :class:`Gather`);
- after its replay, scatters its sampled tokens into ``last`` by the same index.

Each op here costs the host a dispatch (on the NPU an aclnn launch; in the worker's
thread it is most of a decode's host work outside its patches), so the views these ops
read and write are made once per instance (:meth:`PersistentBatch.views`) and kept.

Every one of these runs on the capture stream, in issue order, so each reads what the
steps issued before it wrote; rows are taken and released at accept time and written at
issue time, so a row freed by one sequence and taken by the next is rewritten after the
last step that read it for the first. What a row holds is tracked as issued, on its
:class:`Sequence`: a step that was planned and never issued leaves nothing stale behind
(the next one writes the blocks still missing), and a token that its sequence did not
sample in its last step planned is refused, never fed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphlane.protocol.errors import NoPreviousToken
from graphlane.workers.backends.base import DeviceBackend

PADDING = 0  # the row padding rows gather: the scratch block, token 0


@dataclass(eq=False, slots=True)
class Sequence:
    """A sequence a client added: the worker's host record of it (as planned: accept
    order is issue order), its row in the persistent batch, and what that row holds as
    issued."""

    blocks: list[int]  # only ever appended to (append_blocks, a decode's new_blocks)
    length: int  # tokens in the cache once the last step planned for it has run
    sampling: tuple[float, int, float, int]  # temperature, top_k, top_p, seed
    draw: str | None  # the draw its sampling needs (sampling.needs), None: greedy
    row: int
    written: int = 0  # its blocks written to its row (by its add, then by decodes)
    fed: int | None = None  # the length its last issued step fed (None: not issued)


class PersistentBatch:
    """The rows of every added sequence on one device (see the module doc)."""

    def __init__(self, width: int, scratch_block: int, rows: int) -> None:
        self.width = width  # max_blocks_per_seq
        self.scratch = scratch_block
        self.rows = rows  # rows made at first, grown as sequences join
        self._views: dict[int, InstanceViews] = {}  # by the id of an instance's buffers
        self._free: list[int] = []
        self._next = PADDING + 1
        self._backend: DeviceBackend | None = None
        self.tables: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.feed = Gather(self)  # every decode's: what it gathers is in its buffers

    # ------------------------------------------------------------ rows (accept time)
    def take_row(self) -> int:
        """A row for a sequence being added (its device entries are written when its add
        is issued)."""
        if self._free:
            return self._free.pop()
        self._next += 1
        return self._next - 1

    def release_row(self, row: int) -> None:
        self._free.append(row)

    # ------------------------------------------------------------ device (issue time, on S)
    def bind(self, backend: DeviceBackend) -> None:
        """The device tensors, made on first use: ``backend``'s current stream must be the
        one every later call issues on."""
        if self._backend is not None:
            return
        self._backend = backend
        self._grow(max(self.rows, 16))

    def _grow(self, rows: int) -> None:
        b = self._backend
        assert b is not None
        tables = b.empty((rows, self.width), torch.int32)
        tables.fill_(self.scratch)
        last = b.empty((rows,), torch.int64)
        last.zero_()
        if self.tables is not None and self.last is not None:
            tables[: self.tables.shape[0]].copy_(self.tables)
            last[: self.last.shape[0]].copy_(self.last)
        self.tables, self.last = tables, last

    def join(self, seq: Sequence) -> None:
        """Write an added sequence's whole row: its blocks, the scratch block past them."""
        b, row = self._backend, seq.row
        assert b is not None and self.tables is not None
        while row >= self.tables.shape[0]:
            self._grow(2 * self.tables.shape[0])
        blocks = seq.blocks
        pad = [self.scratch] * (self.width - len(blocks))
        b.copy_in(self.tables[row], torch.tensor(blocks + pad, dtype=torch.int32))
        seq.written = len(blocks)

    def prepare(self, seqs: Any, lengths: Any, checked: bool = False) -> None:
        """Before a decode of ``seqs`` (lengths[i] the length row i feeds): refuse it
        (:meth:`check`, nothing written; not again when ``checked``); then write each
        row's new blocks alone."""
        if not checked:
            self.check(seqs, lengths)
        for seq in seqs:
            if seq.written < len(seq.blocks):
                b, tables = self._backend, self.tables
                assert b is not None and tables is not None
                new = seq.blocks[seq.written :]
                b.copy_in(tables[seq.row, seq.written : len(seq.blocks)],
                          torch.tensor(new, dtype=torch.int32))  # fmt: skip
                seq.written = len(seq.blocks)

    @staticmethod
    def check(seqs: Any, lengths: Any) -> None:
        """NoPreviousToken unless each of ``seqs``' rows holds the token its sequence
        sampled at length ``lengths[i] - 1`` (host state alone: nothing is issued)."""
        for i, seq in enumerate(seqs):
            if seq.fed is None or seq.fed + 1 != lengths[i]:
                raise NoPreviousToken(
                    f"sequences[{i}]: its add was not run on this worker (refused, failed "
                    "or lost): no token to feed; add it again"
                    if seq.fed is None
                    else f"sequences[{i}]: its last step run fed length {seq.fed}, not "
                    f"{lengths[i] - 1} (a decode planned before this one was not run): "
                    "free it and add it again"
                )

    def commit(self, seqs: Any, lengths: Any, buffers: dict[str, torch.Tensor]) -> None:
        """After a decode's replay on the instance of ``buffers``: its rows' sampled
        tokens become their last tokens (scattered by the index it gathered by)."""
        assert self.last is not None
        views = self.views(buffers)
        batch = len(seqs)
        self.last.index_put_((views.heads[batch],), views.tokens[batch])
        for seq, n in zip(seqs, lengths, strict=False):
            seq.fed = n

    def views(self, buffers: dict[str, torch.Tensor]) -> InstanceViews:
        """The views of a graph instance's ``buffers`` that its decodes use, made the first
        time they are asked for: a view is a torch op, and in the worker's thread it costs
        what a few dozen lines of Python do."""
        views = self._views.get(id(buffers))
        if views is None:
            views = self._views[id(buffers)] = InstanceViews(buffers)
        return views

    def set_token(self, seq: Sequence, token: torch.Tensor, length: int) -> None:
        """After an add's prefill: its sampled ``token`` [1] is the row's last token."""
        assert self.last is not None
        self.last[seq.row : seq.row + 1].copy_(token)
        seq.fed = length


class InstanceViews:
    """A graph instance's views that its decodes use (:meth:`PersistentBatch.views`): the
    block table and the tokens' column of ``ints`` (the gather writes them), the rows'
    index at the end of ``ints_rows`` (the gather and the commit read it), and for each
    batch size n the first n rows of the index and of the sampled tokens (the commit's;
    the tokens are the decode's output too)."""

    __slots__ = ("buffers", "heads", "index", "table", "token_column", "tokens")

    def __init__(self, buffers: dict[str, torch.Tensor]) -> None:
        self.buffers = buffers  # held: the cache is keyed by its id
        self.table = buffers["block_table"]
        self.token_column = buffers["ints"][:, 0]
        tokens = buffers["tokens"]
        bucket = tokens.shape[0]
        self.index = index = buffers["ints_rows"][3 * bucket :]
        self.tokens = [tokens[:n] for n in range(bucket + 1)]
        self.heads = [index[:n] for n in range(bucket + 1)]


class Gather:
    """A decode's feed (:class:`~.base.Feed`): the block-table rows and last tokens of the
    rows its instance's index names, gathered straight into the instance's buffers, on
    the current stream (the capture stream: after every step issued before it wrote
    them, and after its own host values' copy, which brought the index)."""

    __slots__ = ("batch",)

    def __init__(self, batch: PersistentBatch) -> None:
        self.batch = batch

    def write(self, buffers: dict[str, torch.Tensor]) -> None:
        batch = self.batch
        assert batch.tables is not None and batch.last is not None  # (bound: it joined)
        views = batch.views(buffers)
        torch.index_select(batch.tables, 0, views.index, out=views.table)
        torch.index_select(batch.last, 0, views.index, out=views.token_column)


__all__ = ["PADDING", "Gather", "InstanceViews", "PersistentBatch", "Sequence"]
