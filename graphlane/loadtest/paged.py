"""The load test's workload of a program with a paged KV cache on the device (hello's
``state.kind == "paged_kv"``, e.g. the built-in ``paged_attention``): a scheduler's own
side of it, per device. A block allocator, the host copy of every live sequence's KV
(written to the device with ``kv_write``), the inputs of a continuously batched decode
step (the per-row ``slot_mapping`` and ``block_table`` come from the allocator: they
address the device state), and the reference output of a step computed from the host
copy with ``torch.nn.functional.scaled_dot_product_attention`` (GQA by repeating the KV
heads; no code of graphlane's programs or of the sim).

Its shapes come from the program's hello entry alone. Everything here is host code: the
continuous-batching loop (:mod:`.batching`) sends what it builds and decides what to do
with the answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from graphlane.client import Client, StepReply

from .workload import Call, close_to

#: What the load test fills of a paged program's step (and its kv_write).
PAGED_INPUTS = ("query", "key", "value", "slot_mapping", "block_table")


@dataclass(frozen=True)
class PagedShape:
    """The program's shapes, as the daemon's ``hello`` describes them (``config``)."""

    layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    max_blocks_per_seq: int
    buckets: tuple[int, ...]
    dtype: str

    @classmethod
    def from_description(cls, described: Mapping[str, Any]) -> PagedShape:
        """From a program's ``hello`` entry; ValueError when it is not a paged program."""
        state = described.get("state") or {}
        cfg = described.get("config") or {}
        if state.get("kind") != "paged_kv":
            raise ValueError("the program keeps no paged KV cache (its hello has no state)")
        missing_inputs = [n for n in PAGED_INPUTS if n not in (described.get("inputs") or {})]
        if missing_inputs or "kv_write" not in (state.get("ops") or {}):
            raise ValueError(
                "a paged KV program's steps take inputs " + ", ".join(PAGED_INPUTS)
                + " and its state op kv_write; this one lacks "
                + ", ".join([*missing_inputs, *(["kv_write"] if "kv_write" not in
                                                 (state.get("ops") or {}) else [])])
            )  # fmt: skip
        if "out" not in described.get("outputs", ()):
            raise ValueError("a paged KV program's steps give output out; this one does not")
        ints = ("layers", "num_heads", "num_kv_heads", "head_dim", "block_size",
                "num_blocks", "max_blocks_per_seq")  # fmt: skip
        missing = [k for k in (*ints, "dtype") if k not in cfg]
        if missing:
            raise ValueError(f"the program's hello config lacks {', '.join(missing)}")
        return cls(
            **{k: int(cfg[k]) for k in ints},
            buckets=tuple(int(b) for b in described.get("buckets", cfg.get("buckets", ()))),
            dtype=str(cfg["dtype"]),
        )

    @property
    def max_len(self) -> int:
        return self.block_size * self.max_blocks_per_seq

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "buckets": list(self.buckets)}

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def bucket_for(self, batch: int) -> int:
        return min(b for b in self.buckets if b >= batch)


class BlockAllocator:
    """The scheduler's free list of cache blocks. A block handed out again after it
    was freed counts as reused."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))[::-1]
        self.ever_used: set[int] = set()
        self.reused = 0

    def take(self, n: int) -> list[int] | None:
        """``n`` blocks, or None (nothing taken) when fewer are free."""
        if n > len(self.free):
            return None
        blocks = [self.free.pop() for _ in range(n)]
        self.reused += sum(b in self.ever_used for b in blocks)
        self.ever_used.update(blocks)
        return blocks

    def give_back(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


@dataclass
class Sequence:
    """A live sequence: its blocks (enough for its whole life, taken at admission), the
    host copy of its KV and how much of it the device's cache holds (``length``)."""

    sid: int
    blocks: list[int]
    keys: torch.Tensor  # [layers, capacity, num_kv_heads, head_dim]
    values: torch.Tensor
    length: int  # tokens in the cache (prompt + decoded)
    remaining: int  # tokens still to decode
    generation: int | None = None  # the worker generation its KV was written in

    def slots(self, block_size: int, start: int, stop: int) -> torch.Tensor:
        pos = torch.arange(start, stop)
        blocks = torch.tensor(self.blocks, dtype=torch.int64)
        return blocks[pos // block_size] * block_size + pos % block_size


@dataclass
class PagedScheduler:
    """Sequences, blocks and host KV of one device (a :class:`.workload.SequenceWorkload`)."""

    shape: PagedShape
    gen: torch.Generator
    allocator: BlockAllocator = field(init=False)
    seqs: dict[int, Sequence] = field(default_factory=dict)
    output = "out"
    prefill_bytes: int = 0

    def __post_init__(self) -> None:
        self.allocator = BlockAllocator(self.shape.num_blocks)

    @property
    def max_batch(self) -> int:
        return max(self.shape.buckets)

    @property
    def max_len(self) -> int:
        return self.shape.max_len

    def bucket_for(self, batch: int) -> int:
        return self.shape.bucket_for(batch)

    def _random(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen).to(self.shape.torch_dtype)

    def admit(self, sid: int, prompt: int, decode: int) -> Sequence | None:
        """A new sequence of ``prompt`` random tokens that will decode ``decode`` more,
        with its blocks; None when the cache has too few free blocks for it now."""
        s = self.shape
        total = prompt + decode
        blocks = self.allocator.take(-(-total // s.block_size))
        if blocks is None:
            return None
        kv = (s.layers, total, s.num_kv_heads, s.head_dim)
        seq = Sequence(sid, blocks, self._random(*kv), self._random(*kv), prompt, decode)
        self.seqs[sid] = seq
        return seq

    async def write(self, client: Client, program: str, device: int, sid: int) -> int:
        """``kv_write`` everything the cache should hold of sequence ``sid``."""
        seq = self.seqs[sid]
        n = seq.length
        slots = seq.slots(self.shape.block_size, 0, n)
        key, value = seq.keys[:, :n].contiguous(), seq.values[:, :n].contiguous()
        reply = await client.kv_write(program, device, slots, key, value)
        seq.generation = reply.generation
        self.prefill_bytes += key.nbytes + value.nbytes + slots.nbytes
        return reply.generation

    def generation_of(self, sid: int) -> int | None:
        return self.seqs[sid].generation

    def forget_state(self) -> None:
        for seq in self.seqs.values():
            seq.generation = None

    def end(self, sid: int) -> None:
        self.allocator.give_back(self.seqs.pop(sid).blocks)

    def step(self, sids: list[int], device: int, check: bool) -> Call:
        """The next token of every sequence in ``sids`` (its K/V is in the host copy
        already; :meth:`advance` commits it once the step succeeded)."""
        s = self.shape
        b = len(sids)
        table = torch.zeros(b, s.max_blocks_per_seq, dtype=torch.int32)
        slots, lengths, new_k, new_v = [], [], [], []
        for i, sid in enumerate(sids):
            seq = self.seqs[sid]
            pos = seq.length
            table[i, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
            slots.append(int(seq.slots(s.block_size, pos, pos + 1)[0]))
            lengths.append(pos + 1)
            new_k.append(seq.keys[:, pos])
            new_v.append(seq.values[:, pos])
        inputs = {
            "query": self._random(b, s.num_heads, s.head_dim),
            "key": torch.stack(new_k, dim=1),
            "value": torch.stack(new_v, dim=1),
            "slot_mapping": torch.tensor(slots, dtype=torch.int64),
            "block_table": table,
        }
        params = {"actual_seq_lengths_kv": lengths}
        expected = self.expected(sids, inputs["query"], lengths) if check else None
        return Call(device, b, params, inputs, expected, tuple(sids))

    def advance(self, call: Call) -> list[int]:
        """Commit a succeeded step's tokens; the sequences it finished."""
        done = []
        for sid in call.rows:
            seq = self.seqs[sid]
            seq.length += 1
            seq.remaining -= 1
            if seq.remaining <= 0:
                done.append(sid)
        return done

    def check(self, call: Call, reply: StepReply) -> float | None:
        assert call.expected is not None
        return close_to(reply.outputs[self.output], call.expected, self.shape.torch_dtype)

    def stats(self) -> dict[str, Any]:
        return {"blocks_reused": self.allocator.reused, "prefill_bytes": self.prefill_bytes}

    def expected(self, sids: list[int], query: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The last layer's output of a step from the host copy: layer l+1 attends from
        layer l's output, rounded to the cache dtype as the device keeps it."""
        s = self.shape
        group = s.num_heads // s.num_kv_heads
        x = query
        for layer in range(s.layers):
            rows = []
            for i, (sid, n) in enumerate(zip(sids, lengths, strict=True)):
                seq = self.seqs[sid]
                k = seq.keys[layer, :n].transpose(0, 1).float().repeat_interleave(group, 0)
                v = seq.values[layer, :n].transpose(0, 1).float().repeat_interleave(group, 0)
                q = x[i].float().unsqueeze(1)  # [num_heads, 1, head_dim]
                rows.append(F.scaled_dot_product_attention(q, k, v).squeeze(1))
            x = torch.stack(rows).to(s.torch_dtype)
        return x
