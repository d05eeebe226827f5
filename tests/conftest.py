"""Shared fixtures: the simulated NPU is set up once; each test starts with a clean device."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from daemons import shared_daemon, shared_daemons  # noqa: F401  (fixtures)

from graphlane.sim import reset_device, torch_npu  # noqa: F401  (sets the device up)

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def clean_device() -> Iterator[None]:
    """Every test starts and ends with a device that has no fault and no pending work."""
    reset_device()
    yield
    reset_device()


@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    before = {t for t in threading.enumerate() if not t.name.startswith("sim-")}
    yield
    after = {t for t in threading.enumerate() if not t.name.startswith("sim-")}
    leaked = [t.name for t in after - before if t.is_alive()]
    assert not leaked, f"threads leaked: {leaked}"
