"""pytest fixtures for code tested on the simulated NPU.

Import them into a ``conftest.py``::

    from npusim.testing import clean_device, float32_attention, no_thread_leak  # noqa: F401

``clean_device`` is autouse: every test starts and ends with a device that has no fault
and no pending work (a fault a test provoked does not leak into the next one), and
fails a test that leaves the sim extensions (:mod:`npusim.extensions`) changed.
``float32_attention`` is asked for by name: the test runs with fused attention in
float32, the sim's exact reference (not the NPU's).
``no_thread_leak`` is asked for by name: the test fails if it leaves a thread running
(the sim's own stream threads, named ``sim-*``, are not counted).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from . import extensions, reset_device, torch_npu  # noqa: F401  (sets the device up)


@pytest.fixture(autouse=True)
def clean_device() -> Iterator[None]:
    """Every test starts and ends with a device that has no fault and no pending work,
    and leaves the sim extensions as it found them."""
    reset_device()
    before = extensions.active()
    yield
    reset_device()
    after = extensions.active()
    if after != before:
        extensions.disable(*(after - before))
        extensions.enable(*(before - after))
        pytest.fail(f"the test changed the sim extensions from {sorted(before)} to {sorted(after)}")


@pytest.fixture
def float32_attention() -> Iterator[None]:
    """Fused attention in float32 for the test: the sim's exact reference, not the NPU's."""
    with extensions.enabled("float32_attention"):
        yield


@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    """Fails the test if it leaves a thread (other than the sim's stream threads) alive."""
    before = {t for t in threading.enumerate() if not t.name.startswith("sim-")}
    yield
    after = {t for t in threading.enumerate() if not t.name.startswith("sim-")}
    leaked = [t.name for t in after - before if t.is_alive()]
    assert not leaked, f"threads leaked: {leaked}"
