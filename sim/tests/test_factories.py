"""Factories and data-dependent ops on the simulated NPU, as a model forward uses them.

Factories naming ``device="npu"`` are one device op each, with the output shape their
meta kernel gives; data-carrying constructors copy their data to the device. Ops whose
output shape depends on the data (torch's ``dynamic_output_shape`` tag) run eagerly with
a host read, and are refused inside a capture, where the NPU cannot synchronize.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from npusim import SimUsageError


def _same(npu: Any, cpu: Any) -> None:
    if isinstance(cpu, (tuple, list)):
        assert isinstance(npu, (tuple, list)) and len(npu) == len(cpu)
        for a, b in zip(npu, cpu, strict=True):
            _same(a, b)
        return
    assert npu.device.type == "npu"
    got = npu.cpu()
    assert got.dtype == cpu.dtype and got.shape == cpu.shape
    assert torch.equal(got, cpu)


FACTORIES: dict[str, Callable[[str], Any]] = {
    # composites that allocate an empty tensor and resize it in an out= op
    "arange": lambda d: torch.arange(7, device=d),
    "arange start step dtype": lambda d: torch.arange(1, 9, 3, dtype=torch.float32, device=d),
    "eye": lambda d: torch.eye(3, device=d),
    "eye m": lambda d: torch.eye(2, 4, dtype=torch.int32, device=d),
    "range": lambda d: torch.range(0, 4, 2, device=d),
    # data-carrying constructors (torch copies the data with Python dispatch off)
    "tensor list": lambda d: torch.tensor([[1, 2], [3, 4]], device=d),
    "tensor scalar": lambda d: torch.tensor(2.5, dtype=torch.float16, device=d),
    "tensor bool": lambda d: torch.tensor([True, False], device=d),
    "as_tensor": lambda d: torch.as_tensor([1.0, 2.0], device=d),
    "new_tensor": lambda d: torch.zeros(2, device=d).new_tensor([3, 4]),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_factory_on_the_device_gives_what_it_gives_on_the_cpu(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.range is deprecated
        _same(FACTORIES[name]("npu"), FACTORIES[name]("cpu"))


def test_data_carrying_constructors_take_npu_tensors_and_device_indices() -> None:
    x = torch.tensor([1, 0, 2], device="npu:0")
    _same(torch.as_tensor(x, dtype=torch.float32), torch.tensor([1.0, 0.0, 2.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.tensor(tensor) warns to clone
        copy = torch.tensor(x)
    _same(copy, torch.tensor([1, 0, 2]))
    copy.add_(1)  # a copy, not a view
    _same(x, torch.tensor([1, 0, 2]))


X = torch.tensor([[3, 0, 1], [0, 5, 3]])

DATA_DEPENDENT: dict[str, Callable[[torch.Tensor], Any]] = {
    "nonzero": lambda x: x.nonzero(),
    "nonzero as_tuple": lambda x: torch.nonzero(x, as_tuple=True),
    "argwhere": lambda x: torch.argwhere(x),
    "where cond": lambda x: torch.where(x > 1),
    "boolean mask": lambda x: x[x > 1],
    "masked_select": lambda x: torch.masked_select(x, x != 3),
    "unique": lambda x: torch.unique(x, return_inverse=True, return_counts=True),
    "unique_consecutive": lambda x: torch.unique_consecutive(x.flatten()),
    "unique dim": lambda x: torch.unique(x, dim=1),
    "repeat_interleave": lambda x: torch.repeat_interleave(x.flatten()),
    "bincount": lambda x: torch.bincount(x.flatten()),
}


@pytest.mark.parametrize("name", list(DATA_DEPENDENT))
def test_data_dependent_op_runs_eagerly_with_a_host_read(name: str) -> None:
    x = torch.empty(X.shape, dtype=X.dtype, device="npu")
    x.copy_(X * 2)
    x.div_(2, rounding_mode="floor")  # queued device work the op must see
    _same(DATA_DEPENDENT[name](x), DATA_DEPENDENT[name](X))


@pytest.mark.parametrize("name", ["nonzero", "boolean mask", "masked_select", "unique"])
def test_data_dependent_op_inside_a_capture_is_refused(name: str) -> None:
    x = X.npu()
    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        with pytest.raises(SimUsageError, match="captures"):
            DATA_DEPENDENT[name](x)
        y = x * 2  # the capture goes on
    x.fill_(1)
    g.replay()
    torch.npu.synchronize()
    _same(y, torch.full(X.shape, 2, dtype=X.dtype))
    _same(DATA_DEPENDENT[name](x), DATA_DEPENDENT[name](torch.ones_like(X)))  # eager again
