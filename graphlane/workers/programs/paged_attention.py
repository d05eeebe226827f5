"""The built-in ``paged_attention`` program: decode over a paged KV cache kept on the device.

This is the field's decode graph (vllm-ascend, sglang, torchair, xLLM): the KV cache
lives on the device in blocks and each step carries only the new token's data.

Device state, owned by the program (one per worker, i.e. per device), allocated once by
the first :meth:`allocate` and shared by every captured instance of every bucket::

    key_cache_l, value_cache_l   [num_blocks + 1, block_size, num_kv_heads * head_dim]

Block ``num_blocks`` (one past the scheduler's blocks) is a scratch block that padding
rows write to and read from; blocks 0..num_blocks-1 are the scheduler's to manage.

Static buffers of a graph instance with bucket B::

    query         [B, num_heads, head_dim]              TND layout, one query token per row
    new_key/value [layers, B, num_kv_heads, head_dim]   the step's new token, per layer
    slot_mapping  int64 [B]                             the new token's slot (block*bs + off)
    block_table   int32 [B, max_blocks_per_seq]
    out_l         [B, num_heads, head_dim]; lse_l float32 [B, num_heads, 1]

Captured per layer l, behind ExternalEvent ev[l]::

    ev[l].wait(S); ev[l].reset(S)
    key_cache_l.view(-1, KV_N, D).index_copy_(0, slot_mapping, new_key[l])     (not patched)
    value_cache_l.view(-1, KV_N, D).index_copy_(0, slot_mapping, new_value[l])
    task group: FIA(query or out_{l-1}, key_cache_l, value_cache_l, block_table,
                    block_size, TND, actual_seq_lengths=[1..B],
                    actual_seq_lengths_kv=<patched per step>, out=[out_l, lse_l])

The cache writes read only static buffers and a fixed index tensor, so they need no
patch: a replay writes whatever the step copied into ``new_key``/``slot_mapping`` (on
the update stream, before ev[l] is recorded). The lengths are the only parameters.

Step: params ``actual_seq_lengths_kv`` (one per row, including the new token, in
1..max_blocks_per_seq*block_size); inputs, all required (a graph instance's buffers
hold another step's rows otherwise): ``query`` [b, num_heads, head_dim], ``key`` and
``value`` [layers, b, num_kv_heads, head_dim], ``slot_mapping`` int64 [b], each row's
own new-token slot (position len-1 of its block table; distinct), ``block_table``
int32 [b, max_blocks_per_seq] whose first ceil(len/block_size) entries of each row
are blocks in 0..num_blocks-1 (the rest are not read). Outputs: ``out`` [b, num_heads,
head_dim] of the last layer and ``lse`` [b, num_heads, 1] (its softmax_lse). Padding
rows (b < B) write to and attend over the scratch block, length 1, and are never
returned.

KV operations (:meth:`plan_state`, :meth:`run_state`), issued by the engine on the
capture stream, so in stream order with every replay: ``kv_write`` (``slots`` [n],
``key``/``value`` [layers, n, num_kv_heads, head_dim]) and ``kv_read`` (``slots`` [n]
-> ``key``/``value`` of that shape).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphlane.workers.backends.base import DeviceBackend

from .base import (
    COMPUTE_DTYPES,
    FIA_OUT,
    FIA_WORKSPACE,
    GraphProgram,
    OpCall,
    ProgramConfigError,
    StepError,
    StepPlan,
    check_attention_config,
    config_values,
    kv_lengths,
)

_INTS = ("layers", "num_heads", "num_kv_heads", "head_dim", "block_size", "num_blocks",
         "max_blocks_per_seq")  # fmt: skip


@dataclass(frozen=True)
class PagedAttentionConfig:
    layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 128
    num_blocks: int = 64
    max_blocks_per_seq: int = 8
    buckets: tuple[int, ...] = (1, 2, 4, 8)
    dtype: str = "float16"

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], where: str) -> PagedAttentionConfig:
        values = config_values(cls.__dataclass_fields__, raw, where)
        cfg = cls(**values)
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "programs.paged_attention") -> None:
        check_attention_config(self, _INTS, where)
        # FIA with a TND query over a paged cache (op-plugin document, as the sim checks it)
        if self.block_size % 128 or not 128 <= self.block_size <= 512:
            raise ProgramConfigError(
                f"{where}.block_size",
                f"must be a multiple of 128 in 128..512 (paged FIA, TND), not {self.block_size}",
            )

    @property
    def max_kv_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    @property
    def slots(self) -> int:
        return self.num_blocks * self.block_size


class PagedAttentionProgram(GraphProgram):
    outputs = ("out", "lse")
    batch_param = "actual_seq_lengths_kv"
    checks_inputs = True  # plan checks every input, values included
    inputs_before_first_group = True  # (input_writes)
    step_wide_signature = True  # every layer's: the step's lengths
    state_ops = {
        "kv_write": "write key/value [layers, n, num_kv_heads, head_dim] into slots [n]",
        "kv_read": "read key/value [layers, n, num_kv_heads, head_dim] of slots [n]",
    }

    def __init__(
        self, config: PagedAttentionConfig | None = None, name: str = "paged_attention"
    ) -> None:
        self.config = c = config or PagedAttentionConfig()
        c.validate()
        self.name = name
        self.buckets = tuple(sorted(c.buckets))
        self.dtype = COMPUTE_DTYPES[c.dtype]
        self.attention_dtype = c.dtype
        self.parameters = {
            "actual_seq_lengths_kv": "one KV length per batch row (the new token included), "
            f"in 1..{c.max_kv_len} (max_blocks_per_seq * block_size)",
        }
        self._fia = dict(
            num_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
            input_layout="TND",
            scale=1.0 / math.sqrt(c.head_dim),
            block_size=c.block_size,
            softmax_lse_flag=True,
        )
        self._cache: dict[str, torch.Tensor] | None = None  # the device state, see allocate
        top = max(self.buckets)
        # Host values of padding rows: the scratch block, one slot each, length 1.
        self._pad_slots = c.slots + torch.arange(top, dtype=torch.int64) % c.block_size
        self._pad_table = torch.full((top, c.max_blocks_per_seq), c.num_blocks, dtype=torch.int32)
        self._q_ends = {b: list(range(1, b + 1)) for b in self.buckets}

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> PagedAttentionProgram:
        name = str(raw.get("name", "paged_attention"))
        return cls(PagedAttentionConfig.from_mapping(raw, f"programs.{name}"), name=name)

    @property
    def num_groups(self) -> int:
        return self.config.layers

    def describe(self) -> dict[str, Any]:
        c = self.config
        new = [c.layers, "batch", c.num_kv_heads, c.head_dim]
        kv = [c.layers, "n", c.num_kv_heads, c.head_dim]
        return {
            **super().describe(),
            "inputs": {
                "query": {"shape": ["batch", c.num_heads, c.head_dim], "dtype": c.dtype},
                "key": {"shape": new, "dtype": c.dtype},
                "value": {"shape": list(new), "dtype": c.dtype},
                "slot_mapping": {"shape": ["batch"], "dtype": "int64"},
                "block_table": {"shape": ["batch", c.max_blocks_per_seq], "dtype": "int32"},
            },
            "output_shapes": {
                "out": {"shape": ["batch", c.num_heads, c.head_dim], "dtype": c.dtype},
                "lse": {"shape": ["batch", c.num_heads, 1], "dtype": "float32"},
            },
            "state": {
                "kind": "paged_kv",
                "num_blocks": c.num_blocks,
                "block_size": c.block_size,
                "slots": c.slots,
                "ops": {
                    "kv_write": {
                        "slots": {"shape": ["n"], "dtype": "int64"},
                        "key": {"shape": kv, "dtype": c.dtype},
                        "value": {"shape": list(kv), "dtype": c.dtype},
                    },
                    "kv_read": {"slots": {"shape": ["n"], "dtype": "int64"}},
                },
            },
            "config": {
                **{k: getattr(c, k) for k in _INTS},
                "buckets": list(c.buckets),
                "dtype": c.dtype,
            },
        }

    # ------------------------------------------------------------ device state
    def _state(self, backend: DeviceBackend) -> dict[str, torch.Tensor]:
        """The KV cache, allocated (zeroed) on first use: once per program and device."""
        if self._cache is None:
            c = self.config
            shape = (c.num_blocks + 1, c.block_size, c.num_kv_heads * c.head_dim)
            cache = {}
            for layer in range(c.layers):
                for kind in ("key", "value"):
                    t = backend.empty(shape, self.dtype)
                    t.zero_()
                    cache[f"{kind}_cache_{layer}"] = t
            self._cache = cache
        return self._cache

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """A cache as [slots, num_kv_heads, head_dim] (a view: same storage)."""
        return t.view(-1, self.config.num_kv_heads, self.config.head_dim)

    # ------------------------------------------------------------ capture
    def allocate(self, backend: DeviceBackend, bucket: int) -> dict[str, torch.Tensor]:
        c = self.config
        cache = self._state(backend)
        q = (bucket, c.num_heads, c.head_dim)
        new = (c.layers, bucket, c.num_kv_heads, c.head_dim)
        bufs = {
            "query": backend.empty(q, self.dtype),
            "new_key": backend.empty(new, self.dtype),
            "new_value": backend.empty(new, self.dtype),
        }
        for layer in range(c.layers):
            bufs[f"out_{layer}"] = backend.empty(q, self.dtype)
            bufs[f"lse_{layer}"] = backend.empty((bucket, c.num_heads, 1), torch.float32)
        for t in bufs.values():
            t.zero_()
        bufs["slot_mapping"] = backend.empty((bucket,), torch.int64)
        bufs["slot_mapping"].copy_(self._pad_slots[:bucket])
        bufs["block_table"] = backend.empty((bucket, c.max_blocks_per_seq), torch.int32)
        bufs["block_table"].copy_(self._pad_table[:bucket])
        bufs.update(cache)  # shared by every instance: the same tensors
        args = self._arguments(bufs, 0, [c.max_kv_len] * bucket)
        workspace = paged_workspace(backend, args, c.num_blocks, c.max_blocks_per_seq)
        if workspace is not None:  # None: a backend without a device (null)
            bufs["workspace"] = workspace
        return bufs

    def _arguments(
        self, bufs: dict[str, torch.Tensor], layer: int, lengths: list[int]
    ) -> dict[str, Any]:
        query = bufs["query"] if layer == 0 else bufs[f"out_{layer - 1}"]
        out = [bufs[f"out_{layer}"], bufs[f"lse_{layer}"]]
        return paged_arguments(bufs, layer, query, out, self._q_ends[len(lengths)], lengths,
                               self._fia)  # fmt: skip

    def capture(
        self,
        backend: DeviceBackend,
        stream: Any,
        bucket: int,
        buffers: dict[str, torch.Tensor],
        events: list[Any],
    ) -> tuple[list[Any], list[Any]]:
        # Captured with every row at length 1 on the scratch block (what the buffers
        # hold): valid whatever the cache's size; the first step patches the lengths.
        lengths = [1] * bucket
        slots = buffers["slot_mapping"]
        handles = []
        for layer in range(self.config.layers):
            backend.wait_external(stream, events[layer])  # wait, reset
            for kind in ("key", "value"):
                cache = self._rows(buffers[f"{kind}_cache_{layer}"])
                cache.index_copy_(0, slots, buffers[f"new_{kind}"][layer])
            backend.task_group_begin(stream)
            backend.call(FIA_OUT, (), self._arguments(buffers, layer, lengths))
            handles.append(backend.task_group_end(stream))
        return handles, [tuple(lengths)] * self.config.layers

    # ------------------------------------------------------------ steps
    def plan(
        self, batch: int, params: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]
    ) -> StepPlan:
        c = self.config
        bucket = self.bucket_for(batch)
        lengths = kv_lengths(params, batch, c.max_kv_len, "max_blocks_per_seq * block_size")
        self._check_inputs(batch, lengths, inputs)
        padded = tuple(lengths) + (1,) * (bucket - batch)
        return StepPlan(self.name, batch, bucket, {"lengths": padded}, dict(inputs))

    def _check_inputs(self, batch: int, lengths: Any, inputs: Mapping[str, torch.Tensor]) -> None:
        c = self.config
        expected = {
            "query": ((batch, c.num_heads, c.head_dim), self.dtype),
            "key": ((c.layers, batch, c.num_kv_heads, c.head_dim), self.dtype),
            "value": ((c.layers, batch, c.num_kv_heads, c.head_dim), self.dtype),
            "slot_mapping": ((batch,), torch.int64),
            "block_table": ((batch, c.max_blocks_per_seq), torch.int32),
        }
        _check_tensors(inputs, expected, "inputs")
        slots = inputs["slot_mapping"]
        if int(slots.min()) < 0 or int(slots.max()) >= c.slots:
            raise StepError(
                "inputs.slot_mapping",
                f"slots must be in 0..{c.slots - 1} (num_blocks * block_size)",
            )
        table = inputs["block_table"]
        for i, n in enumerate(lengths):
            used = table[i, : -(-n // c.block_size)]
            if int(used.min()) < 0 or int(used.max()) >= c.num_blocks:
                raise StepError(
                    f"inputs.block_table[{i}]",
                    f"the {len(used)} blocks a length of {n} reads must be in "
                    f"0..{c.num_blocks - 1}",
                )
        self._check_slots(batch, lengths, slots, table)

    def _check_slots(
        self, batch: int, lengths: Any, slots: torch.Tensor, table: torch.Tensor
    ) -> None:
        """Each row's new token goes where its block table and length say (position
        length - 1 of its own blocks), never into another sequence's slots; and no two
        rows write one slot (which value it would hold is ambiguous, as in kv_write)."""
        bs = self.config.block_size
        pos = torch.tensor(lengths, dtype=torch.int64) - 1
        own = table[torch.arange(batch), pos // bs].to(torch.int64) * bs + pos % bs
        wrong = (own != slots).nonzero()
        if wrong.numel():
            i = int(wrong[0, 0])
            p = int(pos[i])
            raise StepError(
                f"inputs.slot_mapping[{i}]",
                f"slot {int(slots[i])} is not where row {i}'s new token goes: position {p} "
                f"is slot {int(own[i])} (block_table[{i}][{p // bs}] * block_size + {p % bs})",
            )
        if batch > 1 and int(torch.unique(slots).numel()) != batch:
            seen: dict[int, int] = {}
            for i, slot in enumerate(slots.tolist()):
                if slot in seen:
                    raise StepError(
                        f"inputs.slot_mapping[{i}]",
                        f"rows {seen[slot]} and {i} both write slot {slot} (their block "
                        "tables share the block of their new tokens): its value would be "
                        "ambiguous",
                    )
                seen[slot] = i

    def group_signature(self, plan: StepPlan, group: int) -> Any:
        return plan.values["lengths"]

    def group_call(self, buffers: dict[str, torch.Tensor], plan: StepPlan, group: int) -> OpCall:
        return FIA_OUT, (), self._arguments(buffers, group, list(plan.values["lengths"]))

    def input_writes(
        self, buffers: dict[str, torch.Tensor], plan: StepPlan, group: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Everything lands before group 0: five copies, not two per layer (every layer's
        # new K/V goes in one copy each; fewer, larger host-to-device copies).
        if group:
            return []
        b, bucket, inputs = plan.batch, plan.bucket, plan.inputs
        writes = [
            (buffers["query"][:b], inputs["query"]),
            (buffers["slot_mapping"][:b], inputs["slot_mapping"]),
            (buffers["block_table"][:b], inputs["block_table"]),
            (buffers["new_key"][:, :b], inputs["key"]),
            (buffers["new_value"][:, :b], inputs["value"]),
        ]
        if b < bucket:  # rows of an earlier, larger step must not write the cache
            writes += [
                (buffers["slot_mapping"][b:], self._pad_slots[: bucket - b]),
                (buffers["block_table"][b:], self._pad_table[: bucket - b]),
            ]
        return writes

    def output_views(
        self, buffers: dict[str, torch.Tensor], plan: StepPlan, names: list[str]
    ) -> dict[str, torch.Tensor]:
        last = self.config.layers - 1
        views = {"out": buffers[f"out_{last}"], "lse": buffers[f"lse_{last}"]}
        return {n: views[n][: plan.batch] for n in names}

    # ------------------------------------------------------------ KV operations
    def plan_state(self, op: str, fields: Mapping[str, Any]) -> StepPlan:
        """Validate a KV operation (``kv_write``: slots, key, value; ``kv_read``: slots)."""
        c = self.config
        if op not in self.state_ops:
            raise StepError("op", f"{op!r} is not a KV operation of {self.name!r}")
        slots = fields.get("slots")
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.numel() < 1:
            raise StepError("slots", "must be a 1-D int64 or int32 tensor of at least one slot")
        if slots.dtype not in (torch.int64, torch.int32):
            raise StepError("slots", f"dtype {slots.dtype} instead of int64 or int32")
        n = slots.numel()
        if n > c.slots:
            raise StepError("slots", f"{n} slots; the cache has {c.slots}")
        if int(slots.min()) < 0 or int(slots.max()) >= c.slots:
            raise StepError("slots", f"slots must be in 0..{c.slots - 1} (num_blocks * block_size)")
        inputs = {"slots": slots.to(torch.int64)}
        if op == "kv_write":
            shape = (c.layers, n, c.num_kv_heads, c.head_dim)
            tensors = {k: fields.get(k) for k in ("key", "value")}
            _check_tensors(tensors, {k: (shape, self.dtype) for k in tensors}, "")
            if len(set(inputs["slots"].tolist())) != n:
                raise StepError("slots", "a slot is named twice (its value would be ambiguous)")
            inputs.update(tensors)  # type: ignore[arg-type]
        return StepPlan(self.name, n, 0, {"op": op}, inputs)

    def run_state(self, backend: DeviceBackend, plan: StepPlan) -> dict[str, torch.Tensor]:
        """Issue a KV operation on the current stream; device tensors to copy back."""
        c = self.config
        cache = self._state(backend)
        n = plan.batch
        slots = backend.empty((n,), torch.int64)
        backend.copy_in(slots, plan.inputs["slots"])
        if plan.values["op"] == "kv_write":
            shape = (c.layers, n, c.num_kv_heads, c.head_dim)
            for kind in ("key", "value"):
                staged = backend.empty(shape, self.dtype)
                backend.copy_in(staged, plan.inputs[kind])
                for layer in range(c.layers):
                    self._rows(cache[f"{kind}_cache_{layer}"]).index_copy_(0, slots, staged[layer])
            return {}
        out = {}
        for kind in ("key", "value"):
            rows = [
                self._rows(cache[f"{kind}_cache_{layer}"]).index_select(0, slots)
                for layer in range(c.layers)
            ]
            out[kind] = torch.stack(rows)
        return out


def paged_arguments(
    bufs: dict[str, torch.Tensor],
    layer: int,
    query: torch.Tensor,
    out: list[torch.Tensor],
    q_ends: list[int],
    lengths: list[int],
    fia: dict[str, Any],
) -> dict[str, Any]:
    """The fused attention's ``.out`` arguments for one decode layer over the paged
    caches in ``bufs`` (``key_cache_<layer>``, ``value_cache_<layer>``, ``block_table``,
    the ``workspace`` if any): TND rows ending at ``q_ends``, KV ``lengths`` per row,
    ``fia`` the op's fixed parameters."""
    return dict(
        query=query,
        key=bufs[f"key_cache_{layer}"],
        value=bufs[f"value_cache_{layer}"],
        block_table=bufs["block_table"],
        actual_seq_lengths=q_ends,
        actual_seq_lengths_kv=list(lengths),
        workspace=bufs.get("workspace"),
        out=out,
        **fia,
    )


def paged_workspace(
    backend: DeviceBackend, args: dict[str, Any], num_blocks: int, max_blocks_per_seq: int
) -> torch.Tensor | None:
    """The fused attention workspace for a paged call whose ``args`` (the op's arguments)
    carry the longest lengths. The op checks that the cache has the blocks those need, so
    it is sized against a cache that does when this one is short. None on a backend
    without a device (null)."""
    bucket = args["block_table"].shape[0]
    need = bucket * max_blocks_per_seq
    if need > num_blocks + 1:
        _, block_size, width = args["key"].shape
        big = backend.empty((need, block_size, width), args["key"].dtype)
        table = backend.empty((bucket, max_blocks_per_seq), torch.int32)
        args = dict(args, key=big, value=big, block_table=table)
    args = {k: v for k, v in args.items() if k not in ("out", "workspace")}
    return backend.call(FIA_WORKSPACE, (), args)


def _check_tensors(
    tensors: Mapping[str, Any],
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    where: str,
) -> None:
    prefix = f"{where}." if where else ""
    for name in tensors:
        if name not in expected:
            raise StepError(f"{prefix}{name}", f"unknown input (known: {sorted(expected)})")
    for name, (shape, dtype) in expected.items():
        t = tensors.get(name)
        if t is None:
            raise StepError(f"{prefix}{name}", "is required")
        if not isinstance(t, torch.Tensor):
            raise StepError(f"{prefix}{name}", "must be a tensor")
        if tuple(t.shape) != shape:
            raise StepError(f"{prefix}{name}", f"shape {list(t.shape)} instead of {list(shape)}")
        if t.dtype != dtype:
            raise StepError(f"{prefix}{name}", f"dtype {t.dtype} instead of {dtype}")
