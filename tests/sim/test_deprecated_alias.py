"""graphlane.workers.sim stays importable for one release, as an alias of graphlane.sim."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import pytest

import graphlane.sim

OLD = "graphlane.workers.sim"


def test_the_old_path_warns_and_gives_the_same_module_objects() -> None:
    for name in [n for n in sys.modules if n == OLD or n.startswith(OLD + ".")]:
        del sys.modules[name]  # a fresh import, so that it warns
    with pytest.warns(DeprecationWarning, match="import graphlane.sim instead"):
        old = importlib.import_module(OLD)
    for name in graphlane.sim.__all__:
        assert getattr(old, name) is getattr(graphlane.sim, name), name
    submodules = [m.name for m in pkgutil.iter_modules(graphlane.sim.__path__)]
    assert "torch_npu" in submodules
    for name in submodules:
        new = importlib.import_module(f"graphlane.sim.{name}")
        assert importlib.import_module(f"{OLD}.{name}") is new, name
        assert getattr(old, name) is new, name
        assert new.__name__ == new.__spec__.name == f"graphlane.sim.{name}"  # kept its own
    from graphlane.sim import torch_npu

    assert torch_npu is sys.modules["graphlane.sim.torch_npu"]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{OLD}.no_such_module")
