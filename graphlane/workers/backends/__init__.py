"""Device backends: the interface (:mod:`.base`) and its providers ``sim`` and ``npu``,
plus ``null`` (no device at all) for measuring graphlane's own overhead."""

from __future__ import annotations

from typing import Any

from .base import DeviceBackend

BACKENDS = ("sim", "npu", "null")


def create_backend(name: str, device_index: int = 0, **options: Any) -> DeviceBackend:
    """Make the provider called ``name`` for device ``device_index``."""
    if name == "sim":
        from .sim import SimBackend

        return SimBackend(device_index, **options)
    if name == "null":
        from .null import NullBackend

        return NullBackend(device_index)
    if name == "npu":
        from .npu import NpuBackend

        return NpuBackend.load(device_index)
    raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "DeviceBackend", "create_backend"]
