"""What a worker process is told at spawn: the :class:`WorkerSpec` the orchestrator
builds (it imports this, and :mod:`.entry`, of the workers: no torch)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from graphlane.protocol import security, wire
from graphlane.workers.process_group import GroupSpec


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs; built by the orchestrator, sent at spawn."""

    device: int  # the physical id: what status, logs and metrics name
    backend: str = "sim"
    #: The device's index inside this process, as the device runtime numbers the devices
    #: it makes visible (the daemon pins an npu worker with ASCEND_RT_VISIBLE_DEVICES, so
    #: it is 0 there); None: ``device``.
    runtime_index: int | None = None
    sim: dict[str, Any] | None = None  # backend "sim": the fields of npusim.SimConfig
    programs: tuple[dict[str, Any], ...] = ({"name": "attention"},)
    depth: int = 2  # the config's default (see ServeConfig.depth)
    pipeline: bool = True
    record_order: str = "after-replay"  # or "before-replay" (ENPU: records before the replay)
    endpoint: str = "tcp://127.0.0.1:0"
    max_queued: int = 256
    max_unread_reply_bytes: int = 256 * 2**20  # per connection (WorkerLoop.unread)
    #: How long its socket thread polls for the next request before it sleeps, when
    #: idle (WorkerLoop._sleep); the config's ``idle_spin_us``, "auto" resolved.
    idle_spin_us: float = 0.0
    limits: wire.Limits = field(default_factory=wire.Limits)
    generation: int = 0
    log_level: int = logging.INFO
    log_format: str = "text"
    #: CurveZMQ: the server's keys and the admitted clients, as the daemon read them when
    #: it started (a worker does not read the key files: every restart admits the same)
    keys: security.ServerKeys | None = None
    roles: security.Roles | None = None  # with keys: who may do what (None: anyone all)
    # Fault injection for tests: "fail_start": true, "hang_device_after": N,
    # "device_fault_after": N.
    faults: dict[str, Any] = field(default_factory=dict)
    #: how long a CURVE key's sequences outlive its last connection (SequenceOwners)
    sequence_grace_s: float = 10.0
    cpus: tuple[int, ...] | None = None  # the cores its threads run on (None: any; affinity.py)
    #: Its place in a tensor-parallel group (workers/process_group.py, group.py); None: alone.
    group: GroupSpec | None = None



__all__ = ["WorkerSpec"]
