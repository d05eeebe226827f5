"""The npu provider's own rules (issue 29): a patch whose op fails leaves the update
stream out of update mode (``graph_task_update_end`` runs anyway), and host memory is
staged in pinned memory before an asynchronous copy."""

from __future__ import annotations

import pytest
import torch
from npusim import SimUsageError, torch_npu

from graphlane.workers.backends.npu import NpuBackend
from graphlane.workers.programs import AttentionConfig, AttentionProgram

CFG = AttentionConfig(layers=1, num_heads=4, num_kv_heads=2, head_dim=16, max_kv_len=32,
                      buckets=(1,))  # fmt: skip


def test_a_failed_patch_leaves_the_update_stream_usable() -> None:
    b = NpuBackend(torch_npu, 0, use_fused_update=False)
    program = AttentionProgram(CFG)
    S, U = b.new_stream(), b.new_stream(priority=-1)
    bufs = program.allocate(b, 1)
    events = [b.new_external_event()]
    g = b.new_graph()
    b.synchronize()
    with b.capture(g, S):
        handles, _ = program.capture(b, S, 1, bufs, events)
    op, args, kwargs = program.group_call(bufs, program.plan(1, {program.batch_param: [5]}, {}), 0)
    with pytest.raises(SimUsageError):  # a length the captured workspace cannot hold
        b.patch(U, handles[0], op, args, dict(kwargs, actual_seq_lengths_kv=[10**6]))
    b.patch(U, handles[0], op, args, kwargs, events[0])  # U is not left in update mode
    b.replay(g, S)
    b.synchronize()


def test_host_memory_is_pinned_before_an_asynchronous_copy() -> None:
    """A non_blocking copy from pageable memory is synchronous on the NPU (and refused
    while a capture is underway in the default mode); from pinned memory it is not."""
    b = NpuBackend(torch_npu, 0)
    S = b.new_stream()
    dst = b.empty((8,), torch.float32)
    src = torch.arange(8, dtype=torch.float32)
    g = b.new_graph()
    with b.capture(g, S):  # capture_error_mode "global"
        b.copy_in(dst, src)
    b.replay(g, S)
    b.synchronize()
    assert torch.equal(dst.cpu(), src)
