"""The built-in ``attention`` program: a decode-shaped stack of fused attention layers.

Static buffers of a graph instance with bucket B:
    query          [B, num_heads, 1, head_dim]
    key_l, value_l [B, num_kv_heads, max_kv_len, head_dim]   for each layer l
    out_l          [B, num_heads, 1, head_dim]               layer l's output
Layer 0 attends from ``query``, layer l+1 from ``out_l``; each layer is one
fused infer attention task group (BNSD, scale 1/sqrt(head_dim), GQA when
num_kv_heads < num_heads) behind its own ExternalEvent.

Step parameters: ``actual_seq_lengths_kv``, one length per batch entry in
1..max_kv_len. Optional inputs: ``query`` [b, num_heads, 1, head_dim], ``key``
and ``value`` [layers, b, num_kv_heads, max_kv_len, head_dim], written into the
static buffers in stream order; a step without ``key``/``value`` attends over what
the instance's buffers hold from an earlier step (any client's) or zeros, as a
decode step over a KV cache kept on the device (see README "Using it"). Output
``out``: the last layer's output [b, num_heads, 1, head_dim]. Padding rows
(b < B) run with length 1 and are never returned.
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
    StepError,
    StepPlan,
    check_attention_config,
    config_values,
    kv_lengths,
)


@dataclass(frozen=True)
class AttentionConfig:
    layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    max_kv_len: int = 256
    buckets: tuple[int, ...] = (1, 2, 4, 8)
    dtype: str = "float16"

    @classmethod
    def from_mapping(
        cls, raw: Mapping[str, Any], where: str = "programs.attention"
    ) -> AttentionConfig:
        values = config_values(cls.__dataclass_fields__, raw, where)
        cfg = cls(**values)
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "programs.attention") -> None:
        check_attention_config(
            self, ("layers", "num_heads", "num_kv_heads", "head_dim", "max_kv_len"), where
        )


class AttentionProgram(GraphProgram):
    outputs = ("out",)
    batch_param = "actual_seq_lengths_kv"
    parameters = {
        "actual_seq_lengths_kv": "one KV length per batch row, in 1..max_kv_len",
    }
    checks_inputs = True  # _check_inputs

    def __init__(self, config: AttentionConfig | None = None, name: str = "attention") -> None:
        self.config = config or AttentionConfig()
        self.config.validate()
        self.name = name
        self.buckets = tuple(sorted(self.config.buckets))
        self.dtype = COMPUTE_DTYPES[self.config.dtype]
        self.attention_dtype = self.config.dtype
        c = self.config
        self._fia = dict(
            num_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
            input_layout="BNSD",
            scale=1.0 / math.sqrt(c.head_dim),
            softmax_lse_flag=False,
        )
        # Per step: batch -> bucket for every batch a bucket holds; the last layer's
        # output buffer; each instance's layer arguments but the lengths (group_call).
        self._bucket_of = {b: self.bucket_for(b) for b in range(1, self.buckets[-1] + 1)}
        self._out = f"out_{c.layers - 1}"
        self._calls: dict[tuple[int, int], tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> AttentionProgram:
        name = str(raw.get("name", "attention"))
        return cls(AttentionConfig.from_mapping(raw, f"programs.{name}"), name=name)

    @property
    def num_groups(self) -> int:
        return self.config.layers

    def describe(self) -> dict[str, Any]:
        c = self.config
        kv = [c.layers, "batch", c.num_kv_heads, c.max_kv_len, c.head_dim]
        return {
            **super().describe(),
            "inputs": {
                "query": {"shape": ["batch", c.num_heads, 1, c.head_dim], "dtype": c.dtype},
                "key": {"shape": kv, "dtype": c.dtype},
                "value": {"shape": list(kv), "dtype": c.dtype},
            },
            "output_shapes": {
                "out": {"shape": ["batch", c.num_heads, 1, c.head_dim], "dtype": c.dtype},
            },
            "config": {
                "layers": c.layers,
                "num_heads": c.num_heads,
                "num_kv_heads": c.num_kv_heads,
                "head_dim": c.head_dim,
                "max_kv_len": c.max_kv_len,
                "buckets": list(c.buckets),
                "dtype": c.dtype,
            },
        }

    # ------------------------------------------------------------ capture
    def allocate(self, backend: DeviceBackend, bucket: int) -> dict[str, torch.Tensor]:
        c = self.config
        q_shape = (bucket, c.num_heads, 1, c.head_dim)
        kv_shape = (bucket, c.num_kv_heads, c.max_kv_len, c.head_dim)
        bufs = {"query": backend.empty(q_shape, self.dtype)}
        for layer in range(c.layers):
            bufs[f"key_{layer}"] = backend.empty(kv_shape, self.dtype)
            bufs[f"value_{layer}"] = backend.empty(kv_shape, self.dtype)
            bufs[f"out_{layer}"] = backend.empty(q_shape, self.dtype)
        bufs["lse"] = backend.empty((1,), torch.float32)
        # Buffers start zeroed, so a step without inputs computes on defined data.
        for t in bufs.values():
            t.zero_()
        full = [c.max_kv_len] * bucket
        sizing = self._arguments(bufs, 0, full)
        del sizing["out"], sizing["workspace"]
        workspace = backend.call(FIA_WORKSPACE, (), sizing)
        if workspace is not None:  # None: a backend without a device (null)
            bufs["workspace"] = workspace
        return bufs

    def _arguments(
        self, bufs: dict[str, torch.Tensor], layer: int, lengths: list[int]
    ) -> dict[str, Any]:
        return dict(
            query=bufs["query"] if layer == 0 else bufs[f"out_{layer - 1}"],
            key=bufs[f"key_{layer}"],
            value=bufs[f"value_{layer}"],
            actual_seq_lengths_kv=list(lengths),
            workspace=bufs.get("workspace"),
            out=[bufs[f"out_{layer}"], bufs["lse"]],
            **self._fia,
        )

    def capture(
        self,
        backend: DeviceBackend,
        stream: Any,
        bucket: int,
        buffers: dict[str, torch.Tensor],
        events: list[Any],
    ) -> tuple[list[Any], list[Any]]:
        full = [self.config.max_kv_len] * bucket
        handles = []
        for layer in range(self.config.layers):
            backend.wait_external(stream, events[layer])  # wait, reset
            backend.task_group_begin(stream)
            backend.call(FIA_OUT, (), self._arguments(buffers, layer, full))
            handles.append(backend.task_group_end(stream))
        return handles, [tuple(full)] * self.config.layers

    # ------------------------------------------------------------ steps
    def plan(
        self, batch: int, params: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]
    ) -> StepPlan:
        bucket = self._bucket_of.get(batch) if type(batch) is int else None
        if bucket is None:
            bucket = self.bucket_for(batch)  # not a batch any bucket holds: says why
        lengths = kv_lengths(params, batch, self.config.max_kv_len, "max_kv_len")
        if inputs:
            self._check_inputs(batch, inputs)
            inputs = dict(inputs)
        else:
            inputs = {}
        padded = tuple(lengths) if bucket == batch else tuple(lengths) + (1,) * (bucket - batch)
        return StepPlan(self.name, batch, bucket, {"lengths": padded}, inputs)

    def _check_inputs(self, batch: int, inputs: Mapping[str, torch.Tensor]) -> None:
        c = self.config
        expected = {
            "query": (batch, c.num_heads, 1, c.head_dim),
            "key": (c.layers, batch, c.num_kv_heads, c.max_kv_len, c.head_dim),
            "value": (c.layers, batch, c.num_kv_heads, c.max_kv_len, c.head_dim),
        }
        for name, t in inputs.items():
            if name not in expected:
                raise StepError(f"inputs.{name}", f"unknown input (known: {sorted(expected)})")
            if not isinstance(t, torch.Tensor):
                raise StepError(f"inputs.{name}", "must be a tensor")
            if tuple(t.shape) != expected[name]:
                raise StepError(
                    f"inputs.{name}", f"shape {list(t.shape)} instead of {list(expected[name])}"
                )
            if t.dtype != self.dtype:
                raise StepError(f"inputs.{name}", f"dtype {t.dtype} instead of {self.dtype}")

    def group_signature(self, plan: StepPlan, group: int) -> Any:
        return plan.values["lengths"]

    def group_call(self, buffers: dict[str, torch.Tensor], plan: StepPlan, group: int) -> OpCall:
        # The arguments but the lengths are the same for every step on an instance:
        # made once, copied per call (the backend gets arguments of its own each time).
        cached = self._calls.get((id(buffers), group))
        if cached is None or cached[0] is not buffers:
            cached = (buffers, self._arguments(buffers, group, []))
            self._calls[(id(buffers), group)] = cached
        kwargs = cached[1].copy()
        kwargs["actual_seq_lengths_kv"] = list(plan.values["lengths"])
        kwargs["out"] = list(kwargs["out"])
        return FIA_OUT, (), kwargs

    def input_writes(
        self, buffers: dict[str, torch.Tensor], plan: StepPlan, group: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        b = plan.batch
        writes = []
        if group == 0 and "query" in plan.inputs:
            writes.append((buffers["query"][:b], plan.inputs["query"]))
        for name in ("key", "value"):
            if name in plan.inputs:
                writes.append((buffers[f"{name}_{group}"][:b], plan.inputs[name][group]))
        return writes

    def output_views(
        self, buffers: dict[str, torch.Tensor], plan: StepPlan, names: list[str]
    ) -> dict[str, torch.Tensor]:
        # The engine checked the names against ``outputs`` when it planned the step.
        out = buffers[self._out]
        if plan.batch != out.shape[0]:  # a full bucket is the buffer itself: no view to make
            out = out[: plan.batch]
        return {name: out for name in names}
