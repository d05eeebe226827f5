"""The ``npu`` provider: torch_npu on Ascend hardware.

Written against a torch_npu *module object*, so the same code runs over the
real torch_npu and over the simulated NPU's ``torch_npu`` namespace (which is
how it is tested). Ops are named as in that namespace and resolved once. Where
torch_npu offers a fused update binding for an op (update_begin + op +
update_end + record in one call, with the GIL released:
``torch_npu._C._npu_fused_infer_attention_score_out_graph(update_stream, handle,
event, ...)`` for the fused infer attention ``.out``), a patch that also releases
uses it; every other op is patched with the four calls.

Devices are named as the Ascend runtime numbers them in this process: under
``ASCEND_RT_VISIBLE_DEVICES`` (the daemon pins each worker to its NPU) the one
visible device is ``npu:0`` whatever its physical id, so ``device_index`` is the
runtime's index; the worker keeps the physical id for status, logs and metrics.
The current device is per host thread in torch_npu: every thread that touches the
device calls :meth:`NpuBackend.enter_thread` first.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch


class NpuBackend:
    name = "npu"

    def __init__(self, torch_npu: Any, device_index: int = 0, use_fused_update: bool = True):
        """``device_index``: the device as the runtime numbers it in this process."""
        self.torch_npu = torch_npu
        self.npu = torch_npu.npu
        self.npu.set_device(device_index)
        self.device = torch.device("npu", device_index)
        self.use_fused_update = use_fused_update
        self._ops: dict[str, Any] = {}  # op name -> the callable, resolved once
        self._fused: dict[str, Any] = {}  # op name -> its fused update binding, or None

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
    def new_stream(self, priority: int = 0) -> Any:
        return self.npu.Stream(device=self.device, priority=priority)

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

    def wait_external(self, stream: Any, event: Any) -> None:
        event.wait(stream)
        event.reset(stream)  # older CANN clears the flag only here

    def synchronize(self) -> None:
        self.npu.synchronize(self.device)

    def enter_thread(self) -> None:
        self.npu.set_device(self.device.index)

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

    def patch(
        self,
        stream: Any,
        handle: Any,
        op: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        release: Any = None,
    ) -> None:
        """Re-issue ``op`` in a task update of ``handle``; then record ``release``."""
        if release is not None:
            fused = self._fused.get(op, _UNRESOLVED)
            if fused is _UNRESOLVED:
                fused = self._fused[op] = self._fused_binding(op)
            if fused is not None:
                fused(stream, handle, release, *args, **kwargs)
                return
        fn = self._ops.get(op) or self._resolve(op)
        with self.npu.stream(stream):
            self.npu.graph_task_update_begin(stream, handle)
            try:
                fn(*args, **kwargs)
            except BaseException as exc:  # the op's error is the one to report
                try:
                    self.npu.graph_task_update_end(stream)  # the stream can update again
                except BaseException as end:
                    exc.add_note(f"ending the abandoned update also failed: {end}")
                raise
            self.npu.graph_task_update_end(stream)
        if release is not None:
            release.record(stream)

    # ------------------------------------------------------------ ops and memory
    def call(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return (self._ops.get(op) or self._resolve(op))(*args, **kwargs)

    def _resolve(self, op: str) -> Any:
        """``op`` ("name" or "name.overload") in the torch_npu namespace."""
        target: Any = self.torch_npu
        try:
            for part in op.split("."):
                target = getattr(target, part)
        except AttributeError:
            raise ValueError(
                f"torch_npu has no op {op!r} (ops are named in torch_npu's namespace, e.g. "
                "'npu_fused_infer_attention_score.out'; call a plain torch op such as "
                "torch.mm on the device tensors directly: docs/programs.md)"
            ) from None
        self._ops[op] = target
        return target

    def _fused_binding(self, op: str) -> Any:
        name = _FUSED_UPDATES.get(op)
        if name is None or not self.use_fused_update:
            return None
        return getattr(getattr(self.torch_npu, "_C", None), name, None)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # An NPU copies pageable host memory synchronously: stage it in pinned memory
        # (torch_npu's caching host allocator keeps the block until the copy ran).
        if not src.is_pinned():
            src = src.pin_memory()
        dst.copy_(src, non_blocking=True)


#: Ops whose patch-and-release torch_npu fuses into one binding of ``torch_npu._C``.
_FUSED_UPDATES = {
    "npu_fused_infer_attention_score.out": "_npu_fused_infer_attention_score_out_graph",
}
_UNRESOLVED = object()
