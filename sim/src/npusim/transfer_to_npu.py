"""``torch_npu.contrib.transfer_to_npu`` of the simulated NPU: importing it makes code
written for CUDA run on the sim, as the wheel's module does on the NPU
(``from torch_npu.contrib import transfer_to_npu`` becomes
``from npusim import transfer_to_npu``). Importing it sets the sim up.

The part of the wheel's ``_init`` that makes sense on the sim, done the same way:

* every name of ``torch.npu.__all__`` is set on ``torch.cuda`` (the wheel's
  ``_apply_patches([["cuda", torch_npu.npu], ...])``), so ``torch.cuda.Stream``,
  ``Event``, ``graph``, ``synchronize``, ``memory_*``... are the sim's;
  ``torch.cuda.CUDAGraph`` is ``NPUGraph``, ``torch.cuda._sleep`` the sim's ``_sleep``;
* a ``cuda`` device (a string, a ``torch.device``, an int where the wheel takes one) passed
  to torch's factory functions (the wheel's ``torch_fn_white_list``), to
  ``Tensor.to/new_*``, ``Module.to/to_empty`` and to ``torch.cuda``'s device functions
  (``torch_cuda_fn_white_list``) is replaced by ``npu``;
* ``Tensor.cuda`` / ``Module.cuda`` are ``.npu``, ``Tensor.is_cuda`` is ``is_npu``.

Left out, as nothing on the sim stands behind them: distributed (HCCL), the profiler,
autocast, TorchScript, inductor and triton, ``torch.cuda.DoubleTensor``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

import torch

from . import torch_npu as _torch_npu  # sets the device up

# The wheel's white lists (torch_npu 2.14 ``contrib/transfer_to_npu.py``), the names this
# torch has.
TORCH_FNS = (
    "logspace", "randint", "hann_window", "rand", "full_like", "ones_like", "rand_like",
    "randperm", "arange", "frombuffer", "normal", "empty_strided", "empty_like",
    "scalar_tensor", "tril_indices", "bartlett_window", "ones", "sparse_coo_tensor", "randn",
    "kaiser_window", "tensor", "triu_indices", "as_tensor", "zeros", "randint_like", "full",
    "eye", "empty", "blackman_window", "zeros_like", "range", "randn_like", "linspace",
    "hamming_window", "load", "set_default_device",
)  # fmt: skip
TENSOR_FNS = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor",
              "new_zeros", "to")  # fmt: skip
MODULE_FNS = ("to", "to_empty")
CUDA_FNS = (
    "get_device_properties", "get_device_name", "get_device_capability", "set_device",
    "synchronize", "mem_get_info", "memory_stats", "memory_summary", "memory_allocated",
    "max_memory_allocated", "reset_max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "reset_max_memory_cached", "reset_peak_memory_stats",
    "default_stream", "current_stream", "get_rng_state", "set_rng_state",
)  # fmt: skip
DEVICE_KWARGS = ("device", "device_type", "map_location", "device_id")


def _npu(arg: Any, replace_int: bool) -> Any:
    if isinstance(arg, str) and "cuda" in arg:
        return arg.replace("cuda", "npu")
    if isinstance(arg, torch.device) and arg.type == "cuda":
        return torch.device("npu" if arg.index is None else f"npu:{arg.index}")
    if replace_int and isinstance(arg, int) and not isinstance(arg, bool):
        return f"npu:{arg}"
    if isinstance(arg, dict):
        return {_npu(k, False): _npu(v, False) for k, v in arg.items()}
    return arg


def _wrapper_cuda(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The wheel's ``_wrapper_cuda``: ``cuda`` devices in the arguments become ``npu``."""
    replace_int = fn.__name__ in ("to", "to_empty")

    @wraps(fn)
    def decorated(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_npu(a, replace_int) for a in args)
        for name in DEVICE_KWARGS:
            if kwargs.get(name) is not None:
                kwargs[name] = _npu(kwargs[name], True)
        return fn(*args, **kwargs)

    decorated.__transfer_to_npu__ = True  # type: ignore[attr-defined]
    return decorated


def _wrap(owner: Any, names: tuple[str, ...]) -> None:
    for name in names:
        fn = getattr(owner, name, None)
        if fn is not None and not getattr(fn, "__transfer_to_npu__", False):
            setattr(owner, name, _wrapper_cuda(fn))


def _is_npu(self: torch.Tensor) -> bool:
    return self.device.type == "npu"


def _init() -> None:
    npu = _torch_npu.npu
    for name in npu.__all__:
        setattr(torch.cuda, name, getattr(npu, name))
    torch.cuda._sleep = npu._sleep
    torch.cuda.CUDAGraph = npu.NPUGraph  # type: ignore[assignment,misc]
    _wrap(torch.cuda, CUDA_FNS)
    _wrap(torch, TORCH_FNS)
    _wrap(torch.Tensor, TENSOR_FNS)
    _wrap(torch.nn.Module, MODULE_FNS)
    torch.Tensor.cuda = torch.Tensor.npu  # type: ignore[attr-defined,method-assign]
    torch.Tensor.is_cuda = property(_is_npu)  # type: ignore[assignment]
    torch.nn.Module.cuda = torch.nn.Module.npu  # type: ignore[attr-defined,method-assign]


_init()
