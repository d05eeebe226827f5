"""The simulated NPU: a CPU device named "npu" with the NPU's stream, event and
graph semantics, and a torch_npu-shaped namespace over it.

    from npusim import torch_npu   # sets the device up
    x = torch.randn(4, 4).npu()

Errors: :class:`SimError` and its subclasses; :func:`reset_device` clears a
device fault (HazardError, DeadlockError) and drops pending device work.
:func:`configure` selects compute or timed mode and the watchdog.
:func:`graph_profile` counts a captured graph's device kernels, AI CPU tasks, memcpys
and host syncs, by op (:mod:`npusim.opsupport`: what an A2 can run).
:mod:`npusim.extensions` turns on, by name, what the sim does beyond the NPU (off by
default; ``NPUSIM_EXTENSIONS`` names them for a child process).
"""

from __future__ import annotations

import os

from . import extensions
from .errors import (
    DeadlockError,
    DeviceFaultError,
    HazardError,
    SimError,
    SimUsageError,
    UpdateKeyIgnoredWarning,
)
from .profile import GraphProfile, graph_profile
from .runtime import RUNTIME, SimConfig, configure

# The edge where a child process learns its extensions (NPUSIM_EXTENSIONS).
extensions.enable(*extensions.parse(os.environ.get(extensions.ENV_VAR, "")))


def reset_device() -> None:
    """Clear a device fault and drop all pending device work, like a device reset."""
    RUNTIME.reset()


def fault() -> SimError | None:
    """The error that faulted the device, if any (without raising it)."""
    return RUNTIME.fault


__all__ = [
    "DeadlockError",
    "DeviceFaultError",
    "GraphProfile",
    "HazardError",
    "SimConfig",
    "SimError",
    "SimUsageError",
    "UpdateKeyIgnoredWarning",
    "configure",
    "extensions",
    "fault",
    "graph_profile",
    "reset_device",
]
