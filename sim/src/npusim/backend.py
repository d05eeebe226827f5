"""Registers the simulated NPU with PyTorch as the "npu" (PrivateUse1) backend."""

from __future__ import annotations

import atexit
import threading

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from . import amp, backward_streams, npu, ops, pinned
from .runtime import RUNTIME, install_thread_edges, shorten_switch_interval
from .tensor import backend_kernel, backend_kernel_of, backend_op_names

_lock = threading.Lock()
_done = False
_keep: list[object] = []


def setup() -> None:
    """Idempotent: rename PrivateUse1 to "npu", install ``torch.npu`` and the op kernels."""
    global _done
    with _lock:
        if _done:
            return
        ops.refuse_real_torch_npu()
        _setup_privateuseone_for_python_backend("npu", backend_module=npu)
        lib = torch.library.Library("_", "IMPL")
        lib.fallback(backend_kernel, dispatch_key="PrivateUse1")
        _keep.append(lib)
        kernels = torch.library.Library("aten", "IMPL")
        for name in backend_op_names():
            kernels.impl(name, backend_kernel_of(name), "PrivateUse1")
        _keep.append(kernels)
        atexit.register(RUNTIME.shutdown)
        install_thread_edges()  # host threads are ordered by start and join
        pinned.install()  # Tensor.pin_memory() works, as with torch_npu
        backward_streams.install()  # backward ops run on the stream backward() was called on
        amp.install()  # torch.autocast("npu") casts as torch_npu's AutocastPrivateUse1 kernels
        # Stream threads stand in for independent hardware queues: hand the GIL
        # over quickly (the default 5 ms lets one busy thread stall a device
        # stream that is ready to run for that long), except in performance mode.
        shorten_switch_interval()

        _done = True
