"""Regressions of the npu tensor found in review: each was a way the sim was wrong."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from npusim import SimUsageError


def test_result_dtype_follows_the_scalar_type_in_any_order() -> None:
    x = torch.ones(2, dtype=torch.int64).npu()
    assert (x * 2).dtype == torch.int64
    assert (x * 2.0).dtype == torch.float32
    assert (x * 2).dtype == torch.int64
    assert (x * 2.0).cpu().tolist() == [2.0, 2.0]


def test_non_blocking_host_copy_is_captured_and_reads_host_memory_at_replay() -> None:
    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    x = torch.zeros(3).npu()
    host = torch.ones(3)
    back = torch.zeros(3)
    # pageable host memory: "global" and "thread_local" captures refuse the copy
    with torch.npu.graph(g, stream=s, capture_error_mode="relaxed"):
        x.copy_(host, non_blocking=True)
        y = x * 2
        back.copy_(y, non_blocking=True)
    torch.npu.synchronize()
    assert x.cpu().tolist() == [0.0, 0.0, 0.0]  # capture does not run the copy
    host.fill_(5)
    g.replay()
    torch.npu.synchronize()
    assert back.tolist() == [10.0, 10.0, 10.0]


def test_blocking_copy_during_capture_is_refused_before_it_runs() -> None:
    s = torch.npu.Stream()
    x = torch.zeros(3).npu()
    with pytest.raises(SimUsageError), torch.npu.graph(torch.npu.NPUGraph(), stream=s):
        x.copy_(torch.ones(3))
    torch.npu.synchronize()
    assert x.cpu().tolist() == [0.0, 0.0, 0.0]


def test_ops_that_would_resize_a_device_tensor_are_refused() -> None:
    with pytest.raises(SimUsageError):
        torch.add(torch.ones(2).npu(), 1, out=torch.empty(0, device="npu"))
    with pytest.raises(SimUsageError):
        torch.arange(4, out=torch.empty(0, dtype=torch.int64, device="npu"))
    assert torch.arange(4, device="npu").tolist() == [0, 1, 2, 3]  # a factory resizes nothing


def test_interpreter_exits_cleanly_with_device_work_still_queued() -> None:
    code = textwrap.dedent(
        """
        import torch
        from npusim import torch_npu
        x = torch.randn(192, 192).npu()
        for _ in range(30):
            x = x @ x / 16
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
