"""``torch.npu`` of the simulated NPU (also ``torch_npu.npu``).

The names follow torch_npu 2.14: streams, events, graphs and the four
``graph_task_*`` functions of the task-group update API.
"""

from __future__ import annotations

from typing import Any

import torch

from .capture import graph
from .device import current_device, device, device_count, set_device, synchronize
from .events import ExternalEvent
from .graphs import (
    NPUGraph,
    graph_pool_handle,
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
    is_current_stream_capturing,
)
from .npu_extras import (
    get_stream_limit,
    make_graphed_callables,
    reset_stream_limit,
    set_stream_limit,
)
from .streams import Event, Stream, current_stream, default_stream, set_stream, stream


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def init() -> None:
    pass


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    torch.manual_seed(seed)


def get_device_name(device: Any = None) -> str:
    return "graphlane simulated NPU"


def empty_cache() -> None:
    pass


def host_empty_cache() -> None:
    pass


__all__ = [
    "Event",
    "ExternalEvent",
    "NPUGraph",
    "Stream",
    "current_device",
    "current_stream",
    "default_stream",
    "device",
    "device_count",
    "empty_cache",
    "get_device_name",
    "get_stream_limit",
    "graph",
    "graph_pool_handle",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "host_empty_cache",
    "is_available",
    "is_current_stream_capturing",
    "make_graphed_callables",
    "manual_seed",
    "manual_seed_all",
    "reset_stream_limit",
    "set_device",
    "set_stream",
    "set_stream_limit",
    "stream",
    "synchronize",
]
