"""Tensor parallelism of the ``model`` program: how a Llama layer is split over the ranks
of a group (as vLLM splits it), each rank's shard of the weights read from the
safetensors files, and the collectives the forward issues between the ranks.

The split (vLLM's ``model_executor/layers/linear.py`` and ``vocab_parallel_embedding.py``),
for ``N`` ranks, rank ``r``:

- q, k, v and gate, up are column-parallel: rank r holds its rows of each weight (its
  output features): query heads ``[r * n/N, (r + 1) * n/N)``, a slice of the
  intermediate features. KV heads split as the query heads while ``N <= kv``; with fewer
  KV heads than ranks each KV head is replicated on ``N / kv`` ranks (rank r holds KV head
  ``r // (N / kv)``), so every rank attends its query heads to their own KV head;
- o and down are row-parallel: rank r holds its columns (its input features), its
  partial product is summed over the ranks by an all-reduce; a bias is added by rank 0
  alone, before the sum;
- the embedding and the LM head split the vocabulary, padded to a multiple of 64
  (``DEFAULT_VOCAB_PADDING_SIZE``) then cut into N equal parts: a rank looks up only the
  tokens of its part (a masked lookup, zeros elsewhere) and an all-reduce sums the
  parts; the LM head's per-rank logits are all-gathered, so every rank holds the whole
  vocabulary's logits, bit for bit the same, and samples the same token.

The collectives are ``torch.distributed`` calls on the group the worker created (HCCL
on the NPU, the sim's "hccl" backend on the sim): tasks on the current stream, so a
capture records them in the graph and every replay runs them again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from graphlane.hf_model import ModelSpec, random_weights, safetensors_files

from .base import ProgramConfigError

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def check_tensor_parallel(spec: ModelSpec, n: Any, where: str) -> None:
    """ProgramConfigError naming ``tensor_parallel`` unless ``n`` ranks can split the
    model as vLLM splits it."""
    key = f"{where}.tensor_parallel"
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ProgramConfigError(key, f"must be a positive integer, not {n!r}")
    if n == 1:
        return
    for name, total in (("num_attention_heads", spec.num_heads),
                        ("intermediate_size", spec.intermediate_size)):  # fmt: skip
        if total % n:
            raise ProgramConfigError(key, f"{n} ranks must divide {name} {total}")
    kv = spec.num_kv_heads
    if n <= kv and kv % n:
        raise ProgramConfigError(
            key, f"{n} ranks must divide num_key_value_heads {kv} (or be a multiple of it)"
        )
    if n > kv and n % kv:
        raise ProgramConfigError(
            key,
            f"{n} ranks replicate num_key_value_heads {kv} only if {kv} divides {n}",
        )


def local_heads(spec: ModelSpec, n: int) -> tuple[int, int]:
    """(query heads, KV heads) one rank of ``n`` holds."""
    return spec.num_heads // n, max(1, spec.num_kv_heads // n)


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``size`` holds of a model: its heads, its slice of the
    intermediate features and of the (padded) vocabulary."""

    spec: ModelSpec
    rank: int = 0
    size: int = 1

    @property
    def heads(self) -> int:
        return local_heads(self.spec, self.size)[0]

    @property
    def kv_heads(self) -> int:
        return local_heads(self.spec, self.size)[1]

    @property
    def kv_first(self) -> int:
        """The first (global) KV head this rank holds."""
        kv, n = self.spec.num_kv_heads, self.size
        return self.rank * kv // n if n <= kv else self.rank // (n // kv)

    @property
    def vocab_part(self) -> int:
        """Rows of the embedding and the LM head per rank (the padded vocab / N)."""
        v = self.spec.vocab_size
        if self.size == 1:
            return v
        return math.ceil(v / VOCAB_PADDING) * VOCAB_PADDING // self.size

    @property
    def vocab_range(self) -> tuple[int, int]:
        """The token ids ``[start, end)`` this rank embeds (end clamped to vocab_size)."""
        v = self.spec.vocab_size
        start = self.rank * self.vocab_part
        return start, max(start, min(start + self.vocab_part, v))

    def cut(self, name: str) -> tuple[int, int, int] | None:
        """How rank ``rank`` cuts the tensor ``name``: (dim, start, stop), or None when
        it holds it whole (norms, and a row-parallel bias: rank 0 adds it)."""
        s, r = self.spec, self.rank
        d, inter = s.head_dim, s.intermediate_size // self.size
        field = name.rsplit(".", 2)[-2]  # q_proj, ..., embed_tokens, lm_head
        if field == "q_proj":
            return 0, r * self.heads * d, (r + 1) * self.heads * d
        if field in ("k_proj", "v_proj"):
            return 0, self.kv_first * d, (self.kv_first + self.kv_heads) * d
        if field in ("gate_proj", "up_proj"):
            return 0, r * inter, (r + 1) * inter
        if name.endswith("bias"):
            return None
        if field == "o_proj":
            return 1, r * self.heads * d, (r + 1) * self.heads * d
        if field == "down_proj":
            return 1, r * inter, (r + 1) * inter
        if field in ("embed_tokens", "lm_head"):
            return (0, *self.vocab_range)
        return None

    def shape(self, name: str, full: tuple[int, ...]) -> tuple[int, ...]:
        """The shape rank ``rank`` holds of ``name`` (whole shape ``full``); the vocabulary
        cut is padded to :attr:`vocab_part` rows."""
        cut = self.cut(name)
        if self.size == 1 or cut is None:
            return full
        dim, start, stop = cut
        rows = self.vocab_part if name.rsplit(".", 2)[-2] in ("embed_tokens", "lm_head") else (
            stop - start)  # fmt: skip
        return tuple(rows if i == dim else n for i, n in enumerate(full))

    def take(self, name: str, tensor: Any) -> torch.Tensor:
        """This rank's part of ``tensor`` (a torch tensor, or a safetensors slice that
        reads only what is indexed), padded with zero rows to its shape."""
        cut = self.cut(name)
        if self.size == 1 or cut is None:
            return tensor[:] if not isinstance(tensor, torch.Tensor) else tensor
        dim, start, stop = cut
        full = tuple(tensor.get_shape() if not isinstance(tensor, torch.Tensor) else tensor.shape)
        want = self.shape(name, full)
        if stop == start:  # a vocabulary part wholly past vocab_size: padding only
            return torch.zeros(want, dtype=tensor.dtype) if isinstance(tensor, torch.Tensor) else (
                torch.zeros(want, dtype=tensor[0:1].dtype))  # fmt: skip
        part = tensor[start:stop] if dim == 0 else tensor[:, start:stop]
        if tuple(part.shape) != want:  # the last vocabulary part: padding rows
            part = torch.cat([part, part.new_zeros((want[0] - part.shape[0], *want[1:]))])
        return part


def shard_weights(
    spec: ModelSpec, directory: str, dtype: torch.dtype, shard: Shard, where: str
) -> dict[str, torch.Tensor]:
    """This rank's part of every tensor of the checkpoint, by Hugging Face name, in
    ``dtype``: each read through ``safe_open(...).get_slice(name)``, so only the rows
    or columns of the part leave the file (never a whole tensor of a split weight). A
    missing or misshapen tensor is refused by name."""
    from safetensors import safe_open

    shapes = spec.weight_shapes()
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(directory, where):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (a safe_open has no __iter__)
                if name not in shapes:
                    continue
                part = st.get_slice(name)
                full = tuple(part.get_shape())
                if full != shapes[name]:
                    raise ProgramConfigError(
                        f"{where}.model",
                        f"{name} has shape {list(full)}, the config says {list(shapes[name])}",
                    )
                out[name] = shard.take(name, part).to(dtype)
    for name in shapes:
        if name not in out:
            raise ProgramConfigError(f"{where}.model", f"the checkpoint has no tensor {name}")
    return out


def random_shard(
    spec: ModelSpec, seed: int, std: float, dtype: torch.dtype, shard: Shard
) -> dict[str, torch.Tensor]:
    """This rank's part of the seeded random weights. The whole model is drawn on the
    host and cut: the draws of one tensor follow those of the previous ones, so a part
    cannot be drawn alone. Fine for the random models (tests and demos, tiny); a real
    model's weights come from its files, part by part (:func:`shard_weights`)."""
    full = random_weights(spec, seed, std, dtype)
    return {name: shard.take(name, t).contiguous() for name, t in full.items()}


@dataclass(frozen=True)
class TensorParallelGroup:
    """The ranks a model is split over: this process's rank, their number and the
    ``torch.distributed`` process group the collectives run on (None: one rank)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    @classmethod
    def join(cls, size: int, where: str) -> TensorParallelGroup:
        """The group of ``size`` ranks the worker process initialised
        (``torch.distributed.init_process_group`` before loading the program); one rank
        needs none. ProgramConfigError naming ``tensor_parallel`` when there is no such
        group."""
        if size == 1:
            return cls()
        import torch.distributed as dist

        key = f"{where}.tensor_parallel"
        if not dist.is_available() or not dist.is_initialized():
            raise ProgramConfigError(
                key,
                f"{size} ranks need torch.distributed initialised in this worker "
                "(init_process_group('hccl', rank=..., world_size=...)) before the program "
                "loads: run the model's ranks as a group of workers",
            )
        world = dist.get_world_size()
        if world != size:
            raise ProgramConfigError(
                key, f"is {size}, but this worker's process group has {world} ranks"
            )
        return cls(dist.get_rank(), size, dist.group.WORLD)

    @property
    def leader(self) -> bool:
        """Rank 0: the rank whose outputs go back to the client."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place (one device task on the current stream)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def embed(self, tokens: torch.Tensor, weight: torch.Tensor, shard: Shard) -> torch.Tensor:
        """Rows of ``tokens`` [T] of the embedding whose part ``weight`` this rank holds:
        a lookup of its own tokens (zeros for the others'), summed over the ranks."""
        if self.size == 1:
            return F.embedding(tokens, weight)
        start, end = shard.vocab_range
        other = (tokens < start) | (tokens >= end)
        rows = F.embedding((tokens - start).masked_fill(other, 0), weight)
        return self.all_reduce(rows.masked_fill(other[:, None], 0.0))

    def gather_logits(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """The whole vocabulary's logits [T, vocab] from each rank's part [T, V/N]: an
        all-gather (rank after rank), then the padding columns dropped."""
        if self.size == 1:
            return local
        import torch.distributed as dist

        t, part = local.shape
        gathered = local.new_empty((self.size * t, part))
        # all_gather_into_tensor, under its torch 2.13 name where it has it
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, local.contiguous(), group=self.group)
        whole = gathered.view(self.size, t, part).permute(1, 0, 2).reshape(t, self.size * part)
        return whole[:, :vocab]


__all__ = [
    "VOCAB_PADDING",
    "Shard",
    "TensorParallelGroup",
    "check_tensor_parallel",
    "local_heads",
    "random_shard",
    "shard_weights",
]
