"""The graph-op handler registry of an ``auto_dispatch_capture`` capture, as torch_npu 2.14
has it (``torch_npu/npu/_npugraph_handlers/npugraph_handler.py``; public names
``torch.npu.NpuGraphOpHandler`` and ``torch.npu.register_npu_graph_handler``).

A handler is a class (never an instance: every hook is a classmethod) registered under
the names ``func.__name__`` gives in a dispatch mode (``"my_op.default"``, ``"my_op.out"``,
and the packet name ``"my_op"``). An auto-dispatch capture wraps each call of a registered
op in an ExternalEvent wait + task group (:mod:`.autodispatch`); ``prepare_capture`` may
swap the op (FIA ``.default`` to ``.out`` with a workspace and outputs), and
``UPDATE_SPECS`` names the positional slots an ``NPUGraph.update`` key replaces.

``_weak_ref_tensor`` is ``torch_npu._C._weak_ref_tensor``: a tensor over the same device
memory that does not keep it allocated (torch_npu's records and vllm-ascend's graph
wrapper hold captured tensors this way). Used after its memory was freed and reused, it
reads the new owner's bytes, as on the NPU.
"""

from __future__ import annotations

import logging
from copy import deepcopy
from typing import Any

import torch

from .tensor import NpuTensor

logger = logging.getLogger(__name__)


def _weak_ref_tensor(tensor: Any) -> Any:
    """``torch_npu._C._weak_ref_tensor``: the same memory, shape and strides, not owned."""
    if not isinstance(tensor, NpuTensor):
        return tensor  # torch_npu returns a non-NPU tensor as it is
    return NpuTensor(tensor._data, tensor.device.index or 0, None)


class NpuGraphOpHandler:
    """torch_npu's ``NpuGraphOpHandler``: stateless hooks of one op family."""

    UPDATE_SPECS: dict[str, list[tuple[str, Any, str]]] = {}

    @classmethod
    def prepare_capture(cls, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        return func, args, kwargs

    @classmethod
    def postprocess_result(cls, result: Any, kwargs: dict[str, Any]) -> Any:
        return result

    @classmethod
    def get_update_specs(cls, op_name: str) -> list[tuple[str, Any, str]]:
        return cls.UPDATE_SPECS.get(op_name, [])

    @classmethod
    def update_args(cls, dispatch_record: Any, update_input: dict[str, Any]) -> None:
        specs = cls.get_update_specs(dispatch_record.op_cache_entry.__name__)
        for loc, idx_or_name, key in specs:
            if key not in update_input:
                continue
            if loc == "arg":
                if len(dispatch_record.args) > idx_or_name:
                    dispatch_record.args[idx_or_name] = update_input[key]
            elif loc == "kwarg":
                dispatch_record.kwargs[idx_or_name] = update_input[key]

    @classmethod
    def record_wrap_kwarg(cls, key: str, value: Any, tensor_param_names: list[str]) -> Any:
        if value is None:
            return None

        def is_npu(t: Any) -> bool:
            return torch.is_tensor(t) and "npu" in str(t.device)

        if isinstance(value, (list, tuple)):
            wrapped = [_weak_ref_tensor(t) if is_npu(t) else deepcopy(t) for t in value]
            return type(value)(wrapped)
        if key in tensor_param_names and is_npu(value):
            return _weak_ref_tensor(value)
        return deepcopy(value)


_NPU_GRAPH_OP_HANDLERS: dict[str, type[NpuGraphOpHandler]] = {}


def register_npu_graph_handler(op_names: Any) -> Any:
    """Class decorator: register the handler class under ``op_names`` (a name or a list);
    a name registered again is overridden with a warning in the log, as in torch_npu."""

    def decorator(cls: type[NpuGraphOpHandler]) -> type[NpuGraphOpHandler]:
        names = op_names if isinstance(op_names, (list, tuple)) else [op_names]
        for name in names:
            if name in _NPU_GRAPH_OP_HANDLERS:
                logger.warning(
                    "NpuGraphOpHandler for '%s' is being overridden: %s -> %s",
                    name, _NPU_GRAPH_OP_HANDLERS[name].__name__, cls.__name__,
                )  # fmt: skip
            _NPU_GRAPH_OP_HANDLERS[name] = cls
        return cls

    return decorator


class TensorListOutHandler(NpuGraphOpHandler):
    """Ops whose ``out`` is a tensor list: the capture returns ``kwargs["out"]``."""

    @classmethod
    def postprocess_result(cls, result: Any, kwargs: dict[str, Any]) -> Any:
        return kwargs["out"]


def specs_for(packet: str, specs: list[tuple[str, Any, str]]) -> dict[str, Any]:
    """``UPDATE_SPECS`` for a packet name and its ``.default`` and ``.out`` overloads."""
    return {name: list(specs) for name in (packet, f"{packet}.default", f"{packet}.out")}


__all__ = [
    "_NPU_GRAPH_OP_HANDLERS",
    "NpuGraphOpHandler",
    "TensorListOutHandler",
    "_weak_ref_tensor",
    "register_npu_graph_handler",
    "specs_for",
]
