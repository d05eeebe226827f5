"""Registers the simulated NPU with PyTorch as the "npu" (PrivateUse1) backend."""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_done = False
_keep: list[object] = []


def setup() -> None:
    """Idempotent: rename PrivateUse1 to "npu", install ``torch.npu`` and the op fallback."""
    global _done
    with _lock:
        if _done:
            return
        if hasattr(torch, "npu") and not getattr(torch.npu, "__graphlane_sim__", False):
            raise RuntimeError(
                "torch.npu already exists (is the real torch_npu imported?); the simulated "
                "NPU cannot be set up in the same process"
            )
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        from . import npu
        from .tensor import factory_fallback

        npu.__graphlane_sim__ = True  # type: ignore[attr-defined]
        _setup_privateuseone_for_python_backend("npu", backend_module=npu)
        lib = torch.library.Library("_", "IMPL")
        lib.fallback(factory_fallback, dispatch_key="PrivateUse1")
        _keep.append(lib)
        from . import ops  # noqa: F401  (registers torch.ops.npu.*)

        _done = True
