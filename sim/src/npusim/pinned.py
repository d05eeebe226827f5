"""Pinned host memory: ``Tensor.pin_memory()`` and ``Tensor.is_pinned()`` as torch_npu
gives them.

torch pins host memory through the PrivateUse1 hooks' pinned-memory allocator, which a
backend written in Python cannot register, so ``pin_memory()`` would raise. The sim
wraps the two methods: ``pin_memory()`` of a CPU tensor that torch cannot pin returns a
copy marked as pinned, and ``is_pinned()`` reports the mark. The copy is ordinary CPU
memory (the sim's host-device copies are asynchronous either way); the mark changes what
the sim checks: a ``non_blocking`` copy from pinned memory is allowed while a capture is
underway (:mod:`.capture_rules`), as on the NPU.
"""

from __future__ import annotations

from typing import Any

import torch

_pin_memory = torch.Tensor.pin_memory
_is_pinned = torch.Tensor.is_pinned


def _sim_pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if getattr(self, "_sim_pinned", False):
        return self
    try:
        return _pin_memory(self, *args, **kwargs)
    except (NotImplementedError, RuntimeError):
        if self.device.type != "cpu":
            raise
    pinned = self.clone()
    pinned._sim_pinned = True  # type: ignore[attr-defined]
    return pinned


def _sim_is_pinned(self: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
    return bool(getattr(self, "_sim_pinned", False)) or _is_pinned(self, *args, **kwargs)


def install() -> None:
    """Idempotent."""
    torch.Tensor.pin_memory = _sim_pin_memory  # type: ignore[method-assign,assignment]
    torch.Tensor.is_pinned = _sim_is_pinned  # type: ignore[method-assign,assignment]
