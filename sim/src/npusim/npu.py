"""``torch.npu`` of the simulated NPU (also ``torch_npu.npu``).

The names follow torch_npu 2.14: streams, events, graphs and the four
``graph_task_*`` functions of the task-group update API.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from . import amp as amp
from . import npugraph_handler as _npugraph_handler
from . import npugraph_utils as _npugraph_utils  # noqa: F401  torch_npu.npu._npugraph_utils
from . import rng
from .allocation import (
    empty_cache,
    graph_pool_handle,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    memory_stats_as_nested_dict,
    reset_accumulated_memory_stats,
    reset_max_memory_allocated,
    reset_peak_memory_stats,
)
from .amp import (
    get_amp_supported_dtype,
    get_autocast_dtype,
    is_autocast_enabled,
    set_autocast_dtype,
    set_autocast_enabled,
)
from .capture import graph
from .device import current_device, device, device_count, device_index, set_device, synchronize
from .events import ExternalEvent
from .graphed_callables import make_graphed_callables
from .graphs import NPUGraph, is_current_stream_capturing
from .npu_extras import _sleep as _sleep  # torch.npu._sleep
from .npu_extras import (
    get_device_properties,
    get_stream_limit,
    is_bf16_supported,
    reset_stream_limit,
    set_stream_limit,
)
from .npugraph_handler import NpuGraphOpHandler, register_npu_graph_handler
from .streams import Event, Stream, current_stream, default_stream, set_stream, stream
from .task_groups import (
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
)

# torch_npu.npu._npugraph_handlers: the package of the graph-op handler registry
# (``_npugraph_handlers.npugraph_handler._NPU_GRAPH_OP_HANDLERS``).
_npugraph_handlers = types.ModuleType(f"{__name__}._npugraph_handlers")
_npugraph_handlers.npugraph_handler = _npugraph_handler  # type: ignore[attr-defined]
_npugraph_handlers.NpuGraphOpHandler = NpuGraphOpHandler  # type: ignore[attr-defined]
_npugraph_handlers.register_npu_graph_handler = register_npu_graph_handler  # type: ignore[attr-defined]
#: Marks this module as the simulator's torch.npu (what ops.refuse_real_torch_npu reads).
__graphlane_sim__ = True


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


# Random numbers: the device's own generator, torch_npu's graph-safe philox pair
# (:mod:`.rng`). These must not call torch.manual_seed: it seeds the CPU and then calls
# torch.npu.manual_seed_all itself.
default_generators: tuple[torch.Generator, ...] = rng.DEFAULT_GENERATORS


def _generator(device: Any = None) -> rng.NpuGenerator:
    return rng.default_generator(device_index(device))


def manual_seed(seed: int) -> None:
    _generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for gen in default_generators:
        gen.manual_seed(int(seed))


def seed() -> None:
    _generator().seed()


def seed_all() -> None:
    value = _generator().seed()
    for gen in default_generators:
        gen.manual_seed(value)


def initial_seed() -> int:
    return int(_generator().initial_seed())


def get_rng_state(device: Any = "npu") -> torch.Tensor:
    return _generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "npu") -> None:
    _generator(device).set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for i, state in enumerate(new_states):  # device i's (torch_npu's random.py)
        set_rng_state(state, i)


def get_device_name(device: Any = None) -> str:
    return "graphlane simulated NPU"


def host_empty_cache() -> None:
    pass


__all__ = [
    "Event",
    "ExternalEvent",
    "NPUGraph",
    "NpuGraphOpHandler",
    "Stream",
    "current_device",
    "current_stream",
    "default_generators",
    "default_stream",
    "device",
    "device_count",
    "empty_cache",
    "get_amp_supported_dtype",
    "get_autocast_dtype",
    "get_device_name",
    "get_device_properties",
    "get_rng_state",
    "get_rng_state_all",
    "get_stream_limit",
    "graph",
    "graph_pool_handle",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "host_empty_cache",
    "initial_seed",
    "is_autocast_enabled",
    "is_available",
    "is_bf16_supported",
    "is_current_stream_capturing",
    "make_graphed_callables",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "register_npu_graph_handler",
    "reset_accumulated_memory_stats",
    "reset_max_memory_allocated",
    "reset_peak_memory_stats",
    "reset_stream_limit",
    "seed",
    "seed_all",
    "set_autocast_dtype",
    "set_autocast_enabled",
    "set_device",
    "set_rng_state",
    "set_rng_state_all",
    "set_stream",
    "set_stream_limit",
    "stream",
    "synchronize",
]
