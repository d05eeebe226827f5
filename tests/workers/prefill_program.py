"""The worked example of docs/programs.md: a one-layer prefill attention program.

Query length S > 1, so the op takes its prompt branch and both length lists
matter: ``actual_seq_lengths`` (query rows per batch entry) and
``actual_seq_lengths_kv``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from graphlane.workers.backends.base import DeviceBackend
from graphlane.workers.programs import GraphProgram, StepError, StepPlan


class PrefillProgram(GraphProgram):
    name = "prefill"
    outputs = ("out",)

    def __init__(self, heads: int = 2, seq: int = 4, kv: int = 8, dim: int = 8) -> None:
        self.heads, self.seq, self.kv, self.dim = heads, seq, kv, dim
        self.buckets = (1, 2)

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> PrefillProgram:
        return cls(**{k: int(v) for k, v in raw.items() if k != "name"})

    @property
    def num_groups(self) -> int:
        return 1

    def allocate(self, backend: DeviceBackend, bucket: int) -> dict[str, torch.Tensor]:
        q = (bucket, self.heads, self.seq, self.dim)
        kv = (bucket, self.heads, self.kv, self.dim)
        bufs = {
            "query": backend.empty(q, torch.float16),
            "key": backend.empty(kv, torch.float16),
            "value": backend.empty(kv, torch.float16),
            "out": backend.empty(q, torch.float16),
            "lse": backend.empty((1,), torch.float32),
        }
        for t in bufs.values():
            t.zero_()
        return bufs

    def _args(self, bufs: dict[str, torch.Tensor], q_len: list[int], kv_len: list[int]) -> dict:
        return dict(
            query=bufs["query"], key=bufs["key"], value=bufs["value"],
            actual_seq_lengths=q_len, actual_seq_lengths_kv=kv_len,
            num_heads=self.heads, input_layout="BNSD", scale=1 / math.sqrt(self.dim),
            out=[bufs["out"], bufs["lse"]],
        )  # fmt: skip

    def capture(self, backend, stream, bucket, buffers, events):  # type: ignore[no-untyped-def]
        full = ([self.seq] * bucket, [self.kv] * bucket)
        backend.wait_external(stream, events[0])
        backend.task_group_begin(stream)
        backend.call("npu_fused_infer_attention_score.out", (), self._args(buffers, *full))
        return [backend.task_group_end(stream)], [full]

    def plan(self, batch: int, params: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]):  # type: ignore[no-untyped-def]
        bucket = self.bucket_for(batch)
        q_len, kv_len = params.get("q_len"), params.get("kv_len")
        for field, values, limit in (("q_len", q_len, self.seq), ("kv_len", kv_len, self.kv)):
            if not isinstance(values, list) or len(values) != batch:
                raise StepError(f"params.{field}", f"must be a list of {batch} lengths")
            if any(not 1 <= v <= limit for v in values):
                raise StepError(f"params.{field}", f"lengths must be in 1..{limit}")
        pad = [1] * (bucket - batch)
        values = {"lengths": (tuple(q_len + pad), tuple(kv_len + pad))}  # type: ignore[operator]
        return StepPlan(self.name, batch, bucket, values, dict(inputs))

    def group_signature(self, plan: StepPlan, group: int) -> Any:
        return plan.values["lengths"]

    def group_call(self, buffers, plan, group):  # type: ignore[no-untyped-def]
        q_len, kv_len = plan.values["lengths"]
        return (
            "npu_fused_infer_attention_score.out",
            (),
            self._args(buffers, list(q_len), list(kv_len)),
        )

    def input_writes(self, buffers, plan, group):  # type: ignore[no-untyped-def]
        return [(buffers[n][: plan.batch], t) for n, t in plan.inputs.items()]

    def output_views(self, buffers, plan, names):  # type: ignore[no-untyped-def]
        return {"out": buffers["out"][: plan.batch]}
