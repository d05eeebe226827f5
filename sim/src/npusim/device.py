"""Device indices, the current device and device-wide operations of the simulated NPU.

The current device is per host thread, as with torch_npu; the current stream of
each device is in :mod:`.streams`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .errors import SimUsageError
from .runtime import RUNTIME


class _CurrentDevice(threading.local):
    def __init__(self) -> None:
        self.index = 0


_current = _CurrentDevice()


def current_device() -> int:
    return _current.index


def set_current_device(index: int) -> None:
    _current.index = index


def device_index(device: Any = None) -> int:
    """Index of ``device`` (None, int, "npu", "npu:1", torch.device); None is the current one."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        idx = device
    else:
        text = str(device)
        kind, _, num = text.partition(":")
        if kind != "npu":
            raise SimUsageError(f"expected an npu device, got {text!r}")
        idx = int(num) if num else current_device()
    if idx < 0:
        return current_device()
    if idx >= RUNTIME.device_count:
        raise SimUsageError(
            f"npu:{idx} does not exist: the simulated NPU has {RUNTIME.device_count} devices"
        )
    return idx


def set_device(device: Any) -> None:
    set_current_device(device_index(device))


def device_count() -> int:
    return RUNTIME.device_count


def synchronize(device: Any = None) -> None:
    """Block the host until all work issued to every stream of the device ran."""
    idx = device_index(device)
    with RUNTIME.cond:
        RUNTIME.raise_if_faulted()
        # The streams whose last entry no host observed: the rest's observations are in
        # what every host takes in (a long-lived process made many streams).
        streams = [s for s in RUNTIME.unobserved if s.device_index == idx]
        RUNTIME.host_catch_up_locked()
    for s in streams:
        s.synchronize()


@contextmanager
def device(device: Any) -> Iterator[None]:
    """Make ``device`` the current device inside the block (``torch.npu.device``; None or
    a negative index: no change)."""
    prev = current_device()
    if device is not None:
        set_current_device(device_index(device))
    try:
        yield
    finally:
        set_current_device(prev)
