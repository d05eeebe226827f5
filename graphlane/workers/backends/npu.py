"""The ``npu`` provider: torch_npu on Ascend hardware.

Written against a torch_npu *module object*, so the same code runs over the
real torch_npu and over the simulated NPU's ``torch_npu`` namespace (which is
how it is tested). Where torch_npu offers the fused update binding
``torch_npu._C._npu_fused_infer_attention_score_out_graph(update_stream,
handle, event, ...)`` (update_begin + op + update_end + record, with the GIL
released), updates use it; otherwise the four calls.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch


class NpuBackend:
    name = "npu"

    def __init__(self, torch_npu: Any, device_index: int = 0, use_fused_update: bool = True):
        self.torch_npu = torch_npu
        self.npu = torch_npu.npu
        self.npu.set_device(device_index)
        self.device = torch.device("npu", device_index)
        fused = getattr(
            getattr(torch_npu, "_C", None), "_npu_fused_infer_attention_score_out_graph", None
        )
        self._fused_update = fused if use_fused_update else None
        self._fia_out = torch_npu.npu_fused_infer_attention_score.out

    @classmethod
    def load(cls, device_index: int = 0) -> NpuBackend:
        """The real torch_npu (needs CANN and an Ascend device)."""
        try:
            import torch_npu
        except ImportError as exc:
            raise RuntimeError(
                "backend 'npu' needs torch_npu (pip install 'graphlane[npu]', with CANN); "
                "use backend 'sim' on machines without an Ascend NPU"
            ) from exc
        return cls(torch_npu, device_index)

    # ------------------------------------------------------------ streams and events
    def new_stream(self) -> Any:
        return self.npu.Stream(device=self.device)

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return self.npu.stream(stream)

    def new_event(self) -> Any:
        return self.npu.Event()

    def new_external_event(self) -> Any:
        return self.npu.ExternalEvent()

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize(self) -> None:
        self.npu.synchronize(self.device)

    # ------------------------------------------------------------ graphs
    def new_graph(self) -> Any:
        return self.npu.NPUGraph()

    def capture(self, graph: Any, stream: Any) -> AbstractContextManager[Any]:
        return self.npu.graph(graph, stream=stream)

    def replay(self, graph: Any, stream: Any) -> None:
        with self.npu.stream(stream):
            graph.replay()

    def task_group_begin(self, stream: Any) -> None:
        self.npu.graph_task_group_begin(stream)

    def task_group_end(self, stream: Any) -> Any:
        return self.npu.graph_task_group_end(stream)

    def update_attention(
        self, stream: Any, handle: Any, event: Any, arguments: dict[str, Any]
    ) -> None:
        """Patch one attention task group with ``arguments`` and release its event."""
        if self._fused_update is not None:
            self._fused_update(stream, handle, event, **arguments)
            return
        self.patch_attention(stream, handle, arguments)
        event.record(stream)

    def patch_attention(self, stream: Any, handle: Any, arguments: dict[str, Any]) -> None:
        """Patch one attention task group without releasing its event."""
        with self.npu.stream(stream):
            self.npu.graph_task_update_begin(stream, handle)
            self._fia_out(**arguments)
            self.npu.graph_task_update_end(stream)

    # ------------------------------------------------------------ ops and memory
    def attention_out(self, arguments: dict[str, Any]) -> None:
        self._fia_out(**arguments)

    def attention_workspace(self, arguments: dict[str, Any]) -> torch.Tensor:
        args = {k: v for k, v in arguments.items() if k not in ("out", "workspace")}
        return self.torch_npu._npu_fused_infer_attention_score_get_max_workspace(**args)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
