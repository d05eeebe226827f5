"""Every operation of the wire: its name, its request body and its reply body.

One module per family (:mod:`.control`, :mod:`.steps`, :mod:`.kv`, :mod:`.prefill`,
:mod:`.sequences`); the
same Structs are encoded by the client and decoded by the server, so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphlane.protocol.ops.control import Drain, Hello, Info, Shutdown, Status
from graphlane.protocol.ops.kv import KvRead, KvWrite, Resume
from graphlane.protocol.ops.prefill import Prefill
from graphlane.protocol.ops.sequences import AddSequence, AppendBlocks, Decode, Free
from graphlane.protocol.ops.steps import MAX_OUTPUTS, DeviceResult, Replay, Step, Update

__all__ = [
    "MAX_OUTPUTS",
    "OPS",
    "AddSequence",
    "AppendBlocks",
    "Decode",
    "DeviceResult",
    "Drain",
    "Free",
    "Hello",
    "Info",
    "KvRead",
    "KvWrite",
    "Op",
    "Prefill",
    "Replay",
    "Resume",
    "Shutdown",
    "Status",
    "Step",
    "Update",
]


@dataclass(frozen=True)
class Op:
    name: str
    request: type[Any]
    reply: Any
    device: bool  # answered by a worker (True) or by the daemon (False)


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op("hello", Hello, Info, device=False),
        Op("status", Status, Info, device=False),
        Op("drain", Drain, Info, device=False),
        Op("shutdown", Shutdown, Info, device=False),
        Op("step", Step, DeviceResult, device=True),
        Op("update", Update, DeviceResult, device=True),
        Op("replay", Replay, DeviceResult, device=True),
        Op("kv_write", KvWrite, DeviceResult, device=True),
        Op("kv_read", KvRead, DeviceResult, device=True),
        Op("prefill", Prefill, DeviceResult, device=True),
        Op("resume", Resume, Info, device=True),
        Op("add", AddSequence, DeviceResult, device=True),
        Op("decode", Decode, DeviceResult, device=True),
        Op("append_blocks", AppendBlocks, Info, device=True),
        Op("free", Free, Info, device=True),
    )
}
