"""A scheduler's side of the paged_attention program, for the tests: a block allocator,
a host copy of every sequence's KV, and a reference decode computed from that copy with
``torch.nn.functional.scaled_dot_product_attention`` (no code of graphlane or the sim).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from graphlane.workers.programs import PagedAttentionConfig


@dataclass
class Sequence:
    blocks: list[int]
    keys: torch.Tensor  # [layers, len, num_kv_heads, head_dim], the host's copy
    values: torch.Tensor

    @property
    def length(self) -> int:
        return self.keys.shape[1]


@dataclass
class Scheduler:
    cfg: PagedAttentionConfig
    gen: torch.Generator
    free: list[int] = field(default_factory=list)
    seqs: dict[int, Sequence] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = list(range(self.cfg.num_blocks))[::-1]
        self.dtype = getattr(torch, self.cfg.dtype)

    def _kv(self, n: int) -> torch.Tensor:
        c = self.cfg
        shape = (c.layers, n, c.num_kv_heads, c.head_dim)
        return torch.randn(shape, generator=self.gen).to(self.dtype)

    def slots(self, seq: Sequence, start: int, stop: int) -> torch.Tensor:
        bs = self.cfg.block_size
        return torch.tensor([seq.blocks[p // bs] * bs + p % bs for p in range(start, stop)])

    def _grow(self, seq: Sequence, length: int) -> None:
        while len(seq.blocks) * self.cfg.block_size < length:
            seq.blocks.append(self.free.pop())

    def prefill(self, sid: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A new sequence with random KV: (slots, key, value) for kv_write."""
        seq = Sequence([], self._kv(length), self._kv(length))
        self._grow(seq, length)
        self.seqs[sid] = seq
        return self.slots(seq, 0, length), seq.keys, seq.values

    def end(self, sid: int) -> None:
        self.free.extend(self.seqs.pop(sid).blocks)

    def decode(self, sids: list[int]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """One decode step's inputs and lengths; the new tokens join the host copy."""
        c = self.cfg
        q = torch.randn(len(sids), c.num_heads, c.head_dim, generator=self.gen).to(self.dtype)
        new_k, new_v = self._kv(len(sids)), self._kv(len(sids))
        slots, lengths = [], []
        table = torch.zeros(len(sids), c.max_blocks_per_seq, dtype=torch.int32)
        for i, sid in enumerate(sids):
            seq = self.seqs[sid]
            pos = seq.length
            self._grow(seq, pos + 1)
            seq.keys = torch.cat([seq.keys, new_k[:, i : i + 1]], dim=1)
            seq.values = torch.cat([seq.values, new_v[:, i : i + 1]], dim=1)
            slots.append(int(self.slots(seq, pos, pos + 1)[0]))
            lengths.append(pos + 1)
            table[i, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        inputs = {
            "query": q,
            "key": new_k,
            "value": new_v,
            "slot_mapping": torch.tensor(slots, dtype=torch.int64),
            "block_table": table,
        }
        return inputs, lengths

    def expected(self, sids: list[int], query: torch.Tensor) -> torch.Tensor:
        """The last layer's output, layer l+1 attending from layer l's output (rounded to
        the cache dtype, as the device stores it)."""
        c = self.cfg
        x = query
        group = c.num_heads // c.num_kv_heads
        for layer in range(c.layers):
            rows = []
            for i, sid in enumerate(sids):
                seq = self.seqs[sid]
                k = seq.keys[layer].transpose(0, 1).float().repeat_interleave(group, 0)
                v = seq.values[layer].transpose(0, 1).float().repeat_interleave(group, 0)
                q = x[i].float().unsqueeze(1)  # [N, 1, D]
                rows.append(F.scaled_dot_product_attention(q, k, v).squeeze(1))
            x = torch.stack(rows).to(self.dtype)
        return x
