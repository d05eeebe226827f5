"""pytest fixtures for code tested on the simulated NPU.

Import them into a ``conftest.py``::

    from npusim.testing import clean_device, no_thread_leak  # noqa: F401  (fixtures)

``clean_device`` is autouse: every test starts and ends with a device that has no fault
and no pending work (a fault a test provoked does not leak into the next one).
``no_thread_leak`` is asked for by name: the test fails if it leaves a thread running
(the sim's own stream threads, named ``sim-*``, are not counted).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from . import reset_device, torch_npu  # noqa: F401  (sets the device up)


@pytest.fixture(autouse=True)
def clean_device() -> Iterator[None]:
    """Every test starts and ends with a device that has no fault and no pending work."""
    reset_device()
    yield
    reset_device()


@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    """Fails the test if it leaves a thread (other than the sim's stream threads) alive."""
    before = {t for t in threading.enumerate() if not t.name.startswith("sim-")}
    yield
    after = {t for t in threading.enumerate() if not t.name.startswith("sim-")}
    leaked = [t.name for t in after - before if t.is_alive()]
    assert not leaked, f"threads leaked: {leaked}"
