"""A strict torch_npu for tests (see tests/strict_npu/README.md): graphlane's simulated NPU
behind torch_npu 2.14's signatures, as ``import torch_npu`` finds it in a deployment."""

from __future__ import annotations

from typing import Any

import torch
from npusim import torch_npu as _sim
from npusim.runtime import RUNTIME

from . import _strict
from ._strict import API, bind, parser_signature, require_device, schema_signature, trace

_visible = _strict.visible_devices()
if _visible is not None:  # the runtime numbers the devices it shows from 0
    RUNTIME.device_count = len(_visible)

from . import npu as npu  # noqa: E402  (after the device count: it may read it)


class _Op:
    """An op overload of torch_npu's namespace, bound against its registered schema."""

    def __init__(self, name: str, impl: Any) -> None:
        self.name = name
        self.impl = impl
        self.sig = schema_signature(API["schemas"][name])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = bind(self.name, self.sig, args, kwargs)
        require_device(self.name)
        trace(self.name, dict(bound.arguments))
        return self.impl(*args, **kwargs)


class _OpPacket(_Op):
    """``torch_npu.<op>``: the default overload; ``.out`` and others as attributes."""

    def __init__(self, name: str, impl: Any) -> None:
        super().__init__(name, impl)
        self._overloads: dict[str, _Op] = {}

    def __getattr__(self, overload: str) -> _Op:
        key = f"{self.name}.{overload}"
        if key not in API["schemas"]:
            raise AttributeError(f"torch_npu 2.14 has no op {key}")
        op = self._overloads.get(overload)
        if op is None:
            op = self._overloads[overload] = _Op(key, getattr(self.impl, overload))
        return op


for _name in API["schemas"]:
    if "." not in _name:
        globals()[_name] = _OpPacket(_name, getattr(_sim, _name))

_FUSED = "_npu_fused_infer_attention_score_out_graph"
_FUSED_SIG = parser_signature(
    API["c_bindings"][_FUSED]["python_arg_parser"], ("update_stream", "handle", "event")
)


def _fused_out_graph(*args: Any, **kwargs: Any) -> Any:
    """update_begin + FIA ``.out`` + update_end + record in one C++ call; traced as the
    four calls it makes (the record by the event's own, which the sim calls)."""
    bound = bind(f"_C.{_FUSED}", _FUSED_SIG, args, kwargs)
    require_device(_FUSED)
    a = dict(bound.arguments)
    stream, handle = a.pop("update_stream"), a.pop("handle")
    del a["event"]
    via = {"via": _FUSED}
    trace("graph_task_update_begin", {"stream": stream, "handle": handle}, **via)
    trace("npu_fused_infer_attention_score.out", a, **via)
    trace("graph_task_update_end", {"stream": stream}, **via)
    return _sim._C._npu_fused_infer_attention_score_out_graph(*args, **kwargs)


class _CNamespace:
    _npu_fused_infer_attention_score_out_graph = staticmethod(_fused_out_graph)

    def __getattr__(self, name: str) -> Any:
        return getattr(_sim._C, name)


_C = _CNamespace()

_pin_memory = torch.Tensor.pin_memory


def _traced_pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    trace("Tensor.pin_memory", {"shape": list(self.shape)})
    return _pin_memory(self, *args, **kwargs)


torch.Tensor.pin_memory = _traced_pin_memory  # type: ignore[method-assign]


def __getattr__(name: str) -> Any:
    return getattr(_sim, name)
