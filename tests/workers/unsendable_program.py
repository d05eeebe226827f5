"""A test program, loaded by ``module:attr``: the ``attention`` program whose first
step's output has a dtype the wire cannot carry (complex64); later steps are as
``attention``'s. Served under the name ``attention``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphlane.workers.programs import AttentionConfig, AttentionProgram, StepPlan


class FirstOutputUnsendable(AttentionProgram):
    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config, name="attention")
        self.views = 0

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> FirstOutputUnsendable:
        table = {k: v for k, v in raw.items() if k != "name"}
        return cls(AttentionConfig.from_mapping(table))

    def output_views(
        self, buffers: dict[str, torch.Tensor], plan: StepPlan, names: list[str]
    ) -> dict[str, torch.Tensor]:
        self.views += 1
        if self.views == 1:
            return {name: torch.zeros(1, dtype=torch.complex64) for name in names}
        return super().output_views(buffers, plan, names)
