"""Tensor-parallel groups: which devices serve one model together, checked at the edge.

A program table's ``tensor_parallel = N`` makes the host's served devices into groups of
N *consecutive* devices (``devices = 4``, N = 2: devices 0 and 1 are group 0, 2 and 3
group 1). The first device of a group is its rank 0, the *leader*: the one worker that
clients reach (``hello`` lists leaders only); the leader forwards every request it
accepts to the other ranks (graphlane/workers/group.py), so that each rank replays the
same steps and the collectives captured in their graphs meet.

The daemon reads N from the raw program tables, without loading torch (a program's own
config, ModelConfig, reads the same key). The check against the host's devices is here
too: a group must fit the NPUs the host has (``/dev/davinci<N>`` on an Ascend host, the
simulated NPU's 8 on the sim); a worker checks again with what its runtime reports.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class GroupError(ValueError):
    """Groups that this host cannot serve; ``key`` names the setting to change (the
    config reports it as its ConfigError)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message

#: The simulated NPU's devices (npusim's ``Runtime.device_count``; a test checks they agree).
SIM_DEVICES = 8

_DAVINCI = re.compile(r"davinci(\d+)")


def program_key(i: int, program: Mapping[str, Any], key: str) -> str:
    """How an error names ``key`` of the ``i``-th ``[[programs]]`` table: as its worker
    names it, ``programs.NAME.KEY`` (the table whose ``name`` is NAME), or
    ``programs[i].KEY`` when the table has no name to go by."""
    name = program.get("name")
    return f"programs.{name}.{key}" if isinstance(name, str) and name else f"programs[{i}].{key}"


def size_key(programs: Iterable[Mapping[str, Any]]) -> str:
    """The setting that sets the group size: the first program's ``tensor_parallel``."""
    for i, p in enumerate(programs):
        if "tensor_parallel" in p:
            return program_key(i, p, "tensor_parallel")
    return "tensor_parallel"


def tensor_parallel(programs: Iterable[Mapping[str, Any]]) -> int:
    """The group size the programs' tables ask for (1: no groups). Every table that names
    ``tensor_parallel`` must name the same N: one worker process per rank serves all the
    programs, so they share its group (a program without the key runs whole on each rank)."""
    sizes: dict[int, str] = {}
    for i, p in enumerate(programs):
        if "tensor_parallel" not in p:
            continue
        n = p["tensor_parallel"]
        key = program_key(i, p, "tensor_parallel")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise GroupError(key, f"must be an integer >= 1 (devices per group), not {n!r}")
        sizes.setdefault(n, key)
    if len(sizes) > 1:
        keys = ", ".join(f"{k} = {n}" for n, k in sizes.items())
        raise GroupError(
            next(iter(sizes.values())),
            f"programs disagree ({keys}): the ranks of a group serve every program, so "
            "every tensor_parallel must be the same",
        )
    return next(iter(sizes), 1)


def host_npus(backend: str, dev: Path = Path("/dev")) -> int | None:
    """The NPUs this host has for ``backend``: the sim's fixed count, the ``davinci<N>``
    device files of an Ascend host (the driver's, one per NPU), None when unknown (the
    null backend has no device)."""
    if backend == "sim":
        return SIM_DEVICES
    if backend == "npu":
        try:
            names = [p.name for p in dev.iterdir()]
        except OSError:
            return 0
        return sum(1 for n in names if _DAVINCI.fullmatch(n))
    return None


@dataclass(frozen=True)
class DeviceGroups:
    """The served devices split into tensor-parallel groups (``size`` 1: no groups)."""

    size: int
    groups: tuple[tuple[int, ...], ...]

    def of(self, device: int) -> tuple[int, tuple[int, ...]]:
        """(group index, its devices in rank order) of ``device``."""
        for i, g in enumerate(self.groups):
            if device in g:
                return i, g
        raise KeyError(device)

    def leaders(self) -> list[int]:
        return [g[0] for g in self.groups]


def plan_groups(
    devices: Sequence[int],
    size: int,
    backend: str,
    dev: Path = Path("/dev"),
    key: str = "tensor_parallel",
) -> DeviceGroups:
    """``devices`` in groups of ``size`` consecutive devices, each checked against the
    host's NPUs (GroupError naming the setting to change: ``key`` is the one that set
    ``size``, :func:`size_key`)."""
    if size == 1:
        return DeviceGroups(1, tuple((d,) for d in devices))
    if backend == "null":
        raise GroupError(
            key,
            "backend 'null' has no device and no collectives: a group needs backend 'sim' "
            "or 'npu' (or set tensor_parallel = 1)",
        )
    have = host_npus(backend, dev)
    where = "the simulated NPU has" if backend == "sim" else f"this host has ({dev}/davinci*)"
    if have == 0:  # a machine without NPUs (no /dev/davinci*): nothing to fit a group to
        raise GroupError(
            key,
            f"this host has no NPU ({dev}/davinci* absent), so no group of {size} fits: "
            "check and serve this config on the Ascend host that runs it "
            "(backend 'sim' serves groups here)",
        )
    if have is not None and size > have:  # first: no device count would serve it
        raise GroupError(
            key,
            f"a group of {size} devices is larger than the {have} NPU(s) {where}: "
            f"set tensor_parallel to at most {have}",
        )
    if len(devices) % size:
        raise GroupError(
            "devices",
            f"{len(devices)} device(s) cannot form groups of tensor_parallel = {size}: serve "
            f"a multiple of {size} devices (each group is {size} consecutive devices)",
        )
    if have is not None:
        missing = [d for d in devices if d >= have]
        if missing:
            raise GroupError(
                "devices",
                f"device(s) {missing} do not exist: {where} {have} NPU(s) (0..{have - 1})",
            )
    return group_devices(devices, size)


def group_devices(devices: Sequence[int], size: int) -> DeviceGroups:
    """``devices`` (a multiple of ``size``, checked by :func:`plan_groups`) in groups of
    ``size`` consecutive devices."""
    groups = tuple(tuple(devices[i : i + size]) for i in range(0, len(devices), size))
    return DeviceGroups(size, groups)


__all__ = [
    "SIM_DEVICES",
    "DeviceGroups",
    "GroupError",
    "group_devices",
    "host_npus",
    "plan_groups",
    "program_key",
    "size_key",
    "tensor_parallel",
]
