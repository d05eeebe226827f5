"""Fixtures the sim's tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from npusim import configure, extensions
from npusim.testing import clean_device, no_thread_leak  # noqa: F401  (fixtures)

torch.set_num_threads(1)


@pytest.fixture
def watchdog() -> Iterator[Callable[[float], None]]:
    """Set the deadlock watchdog for one test; the previous value is restored afterwards."""
    old = configure()

    def set_watchdog(seconds: float) -> None:
        configure(watchdog_s=seconds)

    yield set_watchdog
    configure(watchdog_s=old.watchdog_s)


@pytest.fixture
def watchdog_off() -> Iterator[None]:
    """A hang must not be rescued by the watchdog in tests that expect immediate reports."""
    old = configure().watchdog_s
    configure(watchdog_s=600)
    yield
    configure(watchdog_s=old)


@pytest.fixture(autouse=True)
def no_extension_leak() -> Iterator[None]:
    """A test that turns a sim extension on turns it off again (the next test must see
    the NPU's behaviour)."""
    yield
    leaked = extensions.active()
    if leaked:
        extensions.disable(*leaked)
        pytest.fail(f"the test left sim extensions on: {sorted(leaked)}")


@pytest.fixture
def float32_attention() -> Iterator[None]:
    """Fused attention in float32, the sim's exact reference (not the NPU's)."""
    with extensions.enabled("float32_attention"):
        yield
