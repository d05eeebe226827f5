"""Names of torch_npu that serving stacks touch besides streams, events and graphs.

* ``torch.npu.set_stream_limit / reset_stream_limit / get_stream_limit``: torch_npu caps
  the AI cores (cube) and vector cores a stream's kernels may use. The cap only changes
  speed, which the sim does not model: it is stored and read back, and the argument
  checks are torch_npu's.
* ``torch_npu.get_npu_format`` and ``torch_npu.Format``: sim tensors are always ND.
* torchair's tensor-from-storage constructors ``torch_npu._C._construct_storage_from_data_pointer``
  and ``_construct_NPU_Tensor_From_Storage_And_Metadata``: rebuild a device tensor that
  views the live device storage holding a data pointer.
* ``torch.npu._sleep(cycles)``: a device-side busy wait of ``cycles`` on the current
  stream (torch_npu ``_npu_sleep``; ``torch_npu.testing``'s ``get_cycles_per_ms`` measures
  its rate with two timed events). The sim's clock is :data:`SLEEP_CYCLES_PER_MS`: the
  work item takes that long on the stream's thread (modelled time in timed mode); it is
  captured as a node (refused inside a task group: it is no Cube/Vector kernel of an op).
"""

from __future__ import annotations

import gc
import time
from enum import IntEnum
from typing import Any

import torch

from .device import device_index
from .errors import SimUsageError
from .graphs import Launch
from .runtime import RUNTIME, busy_until
from .streams import Stream, current_stream
from .tensor import NpuTensor

# A 910B-class device, as get_stream_limit reports when no cap was set.
DEVICE_CUBE_CORES = 24
DEVICE_VECTOR_CORES = 48
_LIMITS: dict[Stream, dict[str, int]] = {}


def _check_stream(stream: Any) -> Stream:
    if stream is None:
        raise AssertionError("stream cannot be None")
    if not isinstance(stream, Stream):
        raise AssertionError(f"stream should be torch_npu.npu.Stream, could not be {type(stream)}")
    return stream


def set_stream_limit(stream: Any, cube_num: int = -1, vector_num: int = -1) -> None:
    limits = _LIMITS.setdefault(_check_stream(stream), {})
    if cube_num != -1:
        limits["cube_core_num"] = int(cube_num)
    if vector_num != -1:
        limits["vector_core_num"] = int(vector_num)


def reset_stream_limit(stream: Any) -> None:
    _LIMITS.pop(_check_stream(stream), None)


def get_stream_limit(stream: Any) -> dict[str, int]:
    limits = _LIMITS.get(_check_stream(stream), {})
    return {
        "cube_core_num": limits.get("cube_core_num", DEVICE_CUBE_CORES),
        "vector_core_num": limits.get("vector_core_num", DEVICE_VECTOR_CORES),
    }


# The sim's device clock for ``_sleep`` (a 1 GHz clock: 10**6 cycles a millisecond).
SLEEP_CYCLES_PER_MS = 1_000_000


class SleepWork:
    """``_sleep(cycles)``: a work item that keeps its stream busy for that long."""

    def __init__(self, cycles: int) -> None:
        self.cycles = cycles
        self.label = f"_sleep({cycles})"

    def launch_locked(self, launch: Launch, stream: Stream) -> None:
        pass

    def run(self, ex: Stream, launch: Launch | None = None) -> None:
        ex.tick()
        us = self.cycles * 1000 / SLEEP_CYCLES_PER_MS
        if RUNTIME.config.timed:
            started = ex.resume_at if ex.resume_at is not None else ex.timed_now()
            ex.resume_at = None
            ex.cost.add_at(us, started)
            ex.settle()
        else:
            busy_until(time.perf_counter() + us * 1e-6)


def _sleep(cycles: int) -> None:
    """torch_npu's ``torch.npu._sleep``: sleep ``cycles`` on the current stream."""
    s = current_stream()
    work = SleepWork(int(cycles))
    with RUNTIME.cond:
        if s.capturing is not None:
            s.capturing.add_node(work)
        else:
            s.issue_locked(work)


class Format(IntEnum):
    """``torch_npu.Format`` (the NPU storage formats); sim tensors are always ND."""

    UNDEFINED = -1
    NCHW = 0
    NHWC = 1
    ND = 2
    NC1HWC0 = 3
    FRACTAL_Z = 4
    FRACTAL_NZ = 29


def get_npu_format(tensor: torch.Tensor) -> Format:
    if not isinstance(tensor, NpuTensor):
        raise SimUsageError("get_npu_format needs an npu tensor")
    return Format.ND


class DeviceStorage:
    """What ``_construct_storage_from_data_pointer`` returns: a live device storage."""

    def __init__(self, storage: torch.UntypedStorage, device: torch.device, alloc: Any) -> None:
        self.storage = storage
        self.device = device
        self.alloc = alloc  # the allocation it is (kept alive by the tensors built on it)

    def nbytes(self) -> int:
        return self.storage.nbytes()

    def data_ptr(self) -> int:
        return self.storage.data_ptr()


def _construct_storage_from_data_pointer(data_ptr: int, device: Any, nbytes: int) -> DeviceStorage:
    """The live device storage that holds ``data_ptr`` (a scan of live sim tensors: slow,
    as this is a recovery path)."""
    for obj in gc.get_objects():
        if isinstance(obj, NpuTensor):
            st = obj.untyped_storage()
            base = st.data_ptr()
            if base <= data_ptr < base + max(st.nbytes(), 1) and st.nbytes() >= nbytes:
                return DeviceStorage(st, obj.device, obj._alloc)
    raise SimUsageError(f"no live npu storage holds data pointer {data_ptr:#x}")


def _construct_NPU_Tensor_From_Storage_And_Metadata(
    metadata: dict[str, Any], storage: DeviceStorage
) -> torch.Tensor:
    dtype = metadata["dtype"]
    base = torch.empty(0, dtype=dtype)
    itemsize = base.element_size()
    offset = int(metadata.get("storage_offset", 0))
    offset += (int(metadata.get("data_ptr", storage.data_ptr())) - storage.data_ptr()) // itemsize
    cpu = base.set_(storage.storage, offset, tuple(metadata["size"]), tuple(metadata["stride"]))
    return NpuTensor(cpu, storage.device.index or 0, storage.alloc)


class _NPUDeviceProperties:
    """``torch_npu._C._NPUDeviceProperties``: what ``get_device_properties`` returns."""

    def __init__(self, index: int) -> None:
        self.name = "npusim"
        self.total_memory = RUNTIME.config.device_memory
        self.cube_core_num = DEVICE_CUBE_CORES
        self.vector_core_num = DEVICE_VECTOR_CORES

    def __repr__(self) -> str:
        return (
            f"_NPUDeviceProperties(name='{self.name}', "
            f"total_memory={self.total_memory // (1 << 20)}MB)"
        )


def get_device_properties(device_name: Any = None) -> _NPUDeviceProperties:
    """torch_npu ``npu/__init__.py``: the properties of a device index (or the current
    device); an index outside ``device_count()`` is an AssertionError."""
    index = device_index(device_name)
    if not 0 <= index < RUNTIME.device_count:
        raise AssertionError("Invalid device id")
    return _NPUDeviceProperties(index)


def is_bf16_supported(including_emulation: bool = False) -> bool:
    """torch_npu ``npu/utils.py``: bf16 on 910B-class devices (the sim computes it on the CPU)."""
    return True
