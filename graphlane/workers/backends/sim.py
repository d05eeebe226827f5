"""The ``sim`` provider: the npu provider over the simulated NPU's torch_npu namespace.

Only what the simulator adds lives here: choosing compute or timed mode, the sim
extensions a program needs (float32 fused attention, which the NPU refuses), and a
device reset after a fault.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

import torch
from npusim import SimConfig, configure, extensions, graph_profile

from .npu import NpuBackend


class SimBackend(NpuBackend):
    name = "sim"

    def __init__(
        self,
        device_index: int = 0,
        config: SimConfig | Mapping[str, Any] | None = None,
        use_fused_update: bool = True,
    ) -> None:
        """``config``: a SimConfig, or its fields as the daemon sends them (``[sim]``)."""
        from npusim import torch_npu

        if isinstance(config, Mapping):
            config = SimConfig(**config)
        if config is not None:
            configure(**asdict(config))
        super().__init__(torch_npu, device_index, use_fused_update=use_fused_update)

    def use_extensions(self, programs: Iterable[Any]) -> None:
        """Turn on, for this process, the npusim extensions ``programs`` need (not the
        NPU's: see npusim.extensions): ``float32_attention`` for a program whose compute
        dtype (its ``dtype``, as the built-in programs name it) is float32."""
        if any(getattr(p, "dtype", None) == torch.float32 for p in programs):
            extensions.enable("float32_attention")

    @property
    def extensions_on(self) -> list[str]:
        """The npusim extensions on in this process."""
        return sorted(extensions.active())

    def graph_profile(self, graph: Any) -> dict[str, Any]:
        """What captured ``graph`` will cost on an NPU (npusim.graph_profile), as JSON
        values: device kernels, AI CPU tasks, memcpys and host syncs, with the kernels
        and AI CPU tasks by op, and the sim extensions it used."""
        p = graph_profile(graph)
        return {
            "kernels": p.kernel_count, "aicpu": p.aicpu_count, "memcpy": p.memcpy_count,
            "host_syncs": p.host_syncs, "kernels_by_op": dict(p.kernels),
            "aicpu_by_op": dict(p.aicpu), "memcpy_by_kind": dict(p.memcpy),
            **({"extensions": sorted(p.extensions)} if p.extensions else {}),
        }  # fmt: skip

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # The sim cannot pin host memory (sim/README.md): its copies are queued as they are.
        dst.copy_(src, non_blocking=True)
