"""Deprecated: the simulated NPU is :mod:`graphlane.sim` (this alias goes in the next release).

``graphlane.workers.sim`` and every ``graphlane.workers.sim.<module>`` still import, and
are the very module objects of ``graphlane.sim`` and ``graphlane.sim.<module>``: a
submodule is aliased when it is first imported under the old name, so importing this
package sets nothing up that ``graphlane.sim`` would not (the device is set up by
``torch_npu``, as before). Change ``from graphlane.workers.sim import torch_npu`` to
``from graphlane.sim import torch_npu``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

from graphlane.sim import (
    DeadlockError,
    DeviceFaultError,
    HazardError,
    SimConfig,
    SimError,
    SimUsageError,
    UpdateKeyIgnoredWarning,
    configure,
    fault,
    reset_device,
)

warnings.warn(
    "graphlane.workers.sim is deprecated: import graphlane.sim instead "
    "(from graphlane.sim import torch_npu)",
    DeprecationWarning,
    stacklevel=2,
)

_OLD = __name__ + "."
_NEW = "graphlane.sim."


class _AliasLoader(importlib.abc.Loader):
    """Loads ``graphlane.workers.sim.X`` as the module object ``graphlane.sim.X``."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system gave the module the alias's spec: it keeps its own.
        module.__spec__ = self.spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    graphlane_workers_sim_alias = True  # found again when this package is re-imported

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_OLD):
            return None
        new = _NEW + fullname[len(_OLD) :]
        if new not in sys.modules and importlib.util.find_spec(new) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


if not any(getattr(f, "graphlane_workers_sim_alias", False) for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())


def __getattr__(name: str) -> Any:
    # graphlane.workers.sim.torch_npu after `import graphlane.workers.sim`, as before.
    if importlib.util.find_spec(_NEW + name) is not None:
        return importlib.import_module(_OLD + name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DeadlockError",
    "DeviceFaultError",
    "HazardError",
    "SimConfig",
    "SimError",
    "SimUsageError",
    "UpdateKeyIgnoredWarning",
    "configure",
    "fault",
    "reset_device",
]
