"""Fixtures the sim's tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from npusim import configure
from npusim.testing import clean_device, float32_attention, no_thread_leak  # noqa: F401

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

