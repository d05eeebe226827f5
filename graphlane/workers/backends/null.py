"""The ``null`` provider: a device that does nothing, instantly.

For measuring graphlane's own cost (sockets, codec, event loop, issue and
completion threads) apart from any device, simulated or real: streams and
events are tokens, capture and replay do nothing, buffers are CPU tensors, and
every event is already complete, and inputs are not copied anywhere. Outputs
are whatever the buffers hold (zeros). Never use it to serve real work.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


class _Done:
    """An event that is always complete."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


_DONE = _Done()
_NO_CONTEXT: AbstractContextManager[Any] = nullcontext()


def _meta_op(op: str) -> Any:
    import npusim.torch_npu  # noqa: F401  (registers torch.ops.npu.*: graphlane's own dependency)

    name, _, overload = op.partition(".")
    packet = getattr(torch.ops.npu, name)
    return getattr(packet, overload) if overload else packet


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x


def _zeros_like(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.zeros(x.shape, dtype=x.dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_zeros_like(v) for v in x)
    return x


class NullBackend:
    name = "null"

    def __init__(self, device_index: int = 0) -> None:
        self.device = torch.device("cpu")
        self.device_index = device_index

    def new_stream(self, priority: int = 0) -> Any:
        return object()

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return _NO_CONTEXT  # nothing is issued anywhere: no stream to make current

    def new_event(self) -> Any:
        return _DONE  # every event is complete: one serves for all

    def new_external_event(self) -> Any:
        return _DONE

    def record(self, event: Any, stream: Any) -> None:
        pass

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def wait_external(self, stream: Any, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def enter_thread(self) -> None:
        pass

    def new_graph(self) -> Any:
        return object()

    def capture(self, graph: Any, stream: Any) -> AbstractContextManager[Any]:
        return nullcontext()

    def replay(self, graph: Any, stream: Any) -> None:
        pass

    def task_group_begin(self, stream: Any) -> None:
        pass

    def task_group_end(self, stream: Any) -> Any:
        return object()

    def patch(
        self,
        stream: Any,
        handle: Any,
        op: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        release: Any = None,
    ) -> None:
        pass

    def call(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """No device: an op computes nothing. An op that writes ``out=`` (a patch, an
        ``.out`` overload), returns nothing or has no meta kernel gives None; one that
        returns tensors (the fused norms, rotary, swiglu a program captures) gives zeros
        of the shapes and dtypes its meta kernel (npusim's registration of torch_npu's
        op) says, so a program's graph is built the same way on every backend."""
        if "out" in kwargs:
            return None
        try:
            shapes = _meta_op(op)(*_to_meta(args), **_to_meta(kwargs))
        except NotImplementedError:  # no meta kernel (a workspace getter): nothing
            return None
        return _zeros_like(shapes)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        pass  # no device: inputs go nowhere (the host's own copy is not graphlane's cost)
