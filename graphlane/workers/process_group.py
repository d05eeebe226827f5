"""A rank's place in a tensor-parallel group, and its joining of the group's process group.

The orchestrator builds a :class:`GroupSpec` for each worker of a group (in its
WorkerSpec); the worker calls :func:`join` after it made its device backend and before
it loads a program, so that a program finds ``torch.distributed`` initialised (its rank
and world size) and captures the group's collectives in its graphs. How the ranks then
serve one step together: :mod:`graphlane.workers.group`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

log = logging.getLogger("graphlane.worker")


class GroupUnavailable(RuntimeError):
    """The group could not be formed this time (a rank missing at the rendezvous, a port
    taken meanwhile): the orchestrator restarts the group (see start_failure)."""

    transient = True


@dataclass(frozen=True)
class GroupSpec:
    """A worker's place in its tensor-parallel group (built by the orchestrator)."""

    index: int  # the group's number on this host
    rank: int
    devices: tuple[int, ...]  # the group's devices, in rank order (devices[0]: the leader)
    init_method: str = ""  # torch.distributed's rendezvous (tcp://127.0.0.1:PORT)
    channel: str = ""  # the leader's forwarding socket (tcp://127.0.0.1:PORT)
    timeout_s: float = 120.0  # the rendezvous's and the followers' readiness limit

    @property
    def size(self) -> int:
        return len(self.devices)

    def describe(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "rank": self.rank,
            "size": self.size,
            "devices": list(self.devices),
            "leader": self.devices[0],
        }


def join(group: GroupSpec, backend: Any) -> None:
    """Join the group's process group from this rank's process: its device current
    first, then ``init_process_group("hccl", ...)``, which waits for every rank."""
    import torch.distributed as dist

    npu = getattr(backend, "npu", None)
    if npu is None:
        raise RuntimeError(
            f"backend {backend.name!r} has no collectives: tensor_parallel needs backend "
            "'sim' or 'npu'"
        )
    visible = npu.device_count()
    index = backend.device.index
    if index >= visible:
        raise RuntimeError(
            f"device {group.devices[group.rank]} (rank {group.rank} of group {group.index}) "
            f"is not among the {visible} NPU(s) this process sees; check "
            "ASCEND_RT_VISIBLE_DEVICES and the config's devices"
        )
    npu.set_device(index)
    try:
        dist.init_process_group(
            "hccl",
            rank=group.rank,
            world_size=group.size,
            init_method=group.init_method,
            timeout=timedelta(seconds=group.timeout_s),
        )
    except (RuntimeError, OSError, ValueError) as exc:  # c10d's DistStoreError included
        raise GroupUnavailable(
            f"group {group.index} rank {group.rank}: the group's rendezvous at "
            f"{group.init_method} failed: {exc}"
        ) from exc
    log.info(
        "joined group %d as rank %d of %d (devices %s)",
        group.index,
        group.rank,
        group.size,
        list(group.devices),
    )


__all__ = ["GroupSpec", "GroupUnavailable", "join"]
