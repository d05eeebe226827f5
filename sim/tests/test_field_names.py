"""Names of torch_npu the field's code uses besides the graph API: ``torch.npu._sleep``
(torch_npu.testing's ``get_cycles_per_ms``; upstream's stream tests delay a producer with
it), ``torch.npu.memory_snapshot`` and ``torch_npu.contrib.transfer_to_npu`` (CUDA code run
on the NPU). Each runs its call shape clean with plain-torch numbers; the mutations drop
the fence a consumer needs and the sim reports it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from npusim import HazardError, reset_device, torch_npu  # noqa: F401  (sets up npu)


def _produce_on_side_stream(fenced: bool) -> torch.Tensor:
    x = torch.arange(8, dtype=torch.float32).npu()
    y = torch.zeros(8).npu()
    side = torch.npu.Stream()
    side.wait_stream(torch.npu.current_stream())
    with torch.npu.stream(side):
        torch.npu._sleep(200_000)  # the producer is late: 0.2 ms of device time first
        y.copy_(x * 3)
    if fenced:
        torch.npu.current_stream().wait_stream(side)
    return y.cpu()


def test_sleep_delays_its_stream_and_a_waiting_consumer_sees_the_result() -> None:
    start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
    start.record()
    torch.npu._sleep(1_000_000)
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 1.0  # a lower bound the busy wait guarantees
    torch.testing.assert_close(_produce_on_side_stream(True), torch.arange(8.0) * 3)


def test_sleep_is_captured_and_replayed_as_a_node() -> None:
    x, s = torch.ones(4).npu(), torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        torch.npu._sleep(10_000)
        y = x + 1
    x.fill_(5)
    g.replay()
    torch.testing.assert_close(y.cpu(), torch.full((4,), 6.0))


def test_sleep_before_an_unfenced_read_is_reported() -> None:
    with pytest.raises(HazardError) as err:
        _produce_on_side_stream(False)  # the read may come first: the write then faults
        torch.npu.synchronize()
    assert err.value.kind == "race"
    reset_device()


def test_memory_snapshot_of_graphs_sharing_a_pool() -> None:
    pool = torch.npu.graph_pool_handle()
    x = torch.ones(256 * 1024).npu()  # 1 MiB: a small-pool block outside the graphs
    outs = []
    graphs = [torch.npu.NPUGraph() for _ in range(2)]
    for i, g in enumerate(graphs):
        with torch.npu.graph(g, pool=pool):
            outs.append(x * (i + 2))
    for g in graphs:
        g.replay()
    torch.testing.assert_close(outs[1].cpu(), torch.full((256 * 1024,), 3.0))
    shared = torch.npu.memory_snapshot(pool)
    assert shared and all(seg["segment_pool_id"] == tuple(pool) for seg in shared)
    ptrs = {b["address"] for seg in shared for b in seg["blocks"]
            if b["state"] == "active_allocated"}  # fmt: skip
    assert {o.data_ptr() for o in outs} <= ptrs
    every = torch.npu.memory_snapshot()
    assert any(seg["segment_pool_id"] == (0, 0) and any(
        b["address"] == x.data_ptr() for b in seg["blocks"]) for seg in every)  # fmt: skip
    for seg in every:
        assert seg["total_size"] == sum(b["size"] for b in seg["blocks"])
        assert seg["allocated_size"] <= seg["total_size"]


_CUDA_PROGRAM = """
import torch
from npusim import HazardError, transfer_to_npu

x = torch.ones(6, device="cuda") * torch.tensor([0.0, 1, 2, 3, 4, 5]).cuda()
assert x.is_cuda and x.device.type == "npu"
m = torch.nn.Linear(6, 6).cuda()
assert next(m.parameters()).device.type == "npu"
y = torch.zeros(6).to("cuda:0")
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=torch.cuda.Stream()):
    w = x * 10
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    torch.cuda._sleep(100_000)
    y.copy_(x * 2)
if FENCED:
    torch.cuda.current_stream().wait_stream(side)
try:
    z = y + 1
    g.replay()
    torch.cuda.synchronize()
    print("OK", z.cpu().tolist(), w.cpu().tolist())
except HazardError as exc:
    print("HAZARD", exc.kind)
"""


@pytest.mark.parametrize("fenced", [True, False])
def test_transfer_to_npu_runs_cuda_code(fenced: bool) -> None:
    # A subprocess: the module patches torch.cuda and torch for the whole process.
    src = f"FENCED = {fenced}\n" + textwrap.dedent(_CUDA_PROGRAM)
    run = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr
    last = run.stdout.split("\n")[-2]
    if fenced:
        assert last == f"OK {[2.0 * i + 1 for i in range(6)]} {[10.0 * i for i in range(6)]}"
    else:
        assert last == "HAZARD race", run.stdout
