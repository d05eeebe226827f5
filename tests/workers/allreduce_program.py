"""A test-only tensor-parallel program: the attention program with an all-reduce of its
last layer's output captured in its graph, after the last task group.

It reads ``tensor_parallel`` from its table (as the model program does) and joins no
group itself: the worker has joined it before the program loads. Every rank computes
the same attention over the same forwarded inputs, so a step's ``out`` is ``size`` times
the attention of one device, and only if every rank replayed that step: a rank that
does not would leave the collective unmet (a deadlock on the sim)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from graphlane.workers.programs.attention import AttentionConfig, AttentionProgram
from graphlane.workers.programs.base import ProgramConfigError


class AllReduceAttention(AttentionProgram):
    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> AllReduceAttention:
        raw = dict(raw)
        size = raw.pop("tensor_parallel", 1)
        name = str(raw.get("name", "allreduce"))
        program = cls(AttentionConfig.from_mapping(raw, f"programs.{name}"), name="allreduce")
        program.size = size
        return program

    size = 1

    def capture(self, backend, stream, bucket, buffers, events):  # type: ignore[no-untyped-def]
        if dist.is_initialized() and dist.get_world_size() != self.size:
            raise ProgramConfigError(
                "tensor_parallel",
                f"{self.size}, but this worker's group has {dist.get_world_size()} ranks",
            )
        handles, signatures = super().capture(backend, stream, bucket, buffers, events)
        if dist.is_initialized():
            dist.all_reduce(buffers[self._out])  # a device task on the capture stream
        return handles, signatures
