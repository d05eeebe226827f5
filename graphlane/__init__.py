"""graphlane: keep captured NPU graphs hot and patch their parameters between replays.

import graphlane
async with graphlane.Client("tcp://127.0.0.1:7450") as c:
    r = await c.step("attention", device=0, params={"actual_seq_lengths_kv": [100, 7]})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from graphlane.client import Client, StepReply, SyncClient
    from graphlane.protocol.errors import ErrorCode, GraphlaneError

_EXPORTS = {
    "Client": "graphlane.client",
    "SyncClient": "graphlane.client",
    "StepReply": "graphlane.client",
    "GraphlaneError": "graphlane.protocol.errors",
    "ErrorCode": "graphlane.protocol.errors",
}


def __getattr__(name: str) -> Any:
    # Imported on first use, so that `import graphlane` (e.g. in a worker) stays light.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'graphlane' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["Client", "ErrorCode", "GraphlaneError", "StepReply", "SyncClient", "__version__"]
