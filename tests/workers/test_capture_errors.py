"""A program author's error reaches them (issue 27): an exception raised inside a
capture (inside a task group too) or inside a task update propagates as itself, the
capture or update abandoned cleanly; and a worker's start failure says whether a
restart could help (see graphlane.workers.worker.start_failure)."""

from __future__ import annotations

import pytest
import torch
from misnamed_op_program import MisnamedOp
from npusim import SimUsageError, torch_npu

from graphlane.protocol import pipe
from graphlane.workers.backends.faults import InjectedDeviceFault
from graphlane.workers.backends.npu import NpuBackend
from graphlane.workers.engine import StepEngine
from graphlane.workers.worker import start_failure

FIA = "npu_fused_infer_attention_score.out"


def _notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


@pytest.mark.parametrize("fused", [True, False])
def test_an_error_inside_a_capture_propagates_as_itself(fused: bool) -> None:
    backend = NpuBackend(torch_npu, 0, use_fused_update=fused)
    engine = StepEngine(backend, [MisnamedOp()], on_done=lambda step: None)
    with pytest.raises(ValueError, match="torch_npu has no op 'mm'") as info:
        engine.start()
    # What ending the abandoned capture complained of (the task group the error left
    # open) is a note on the cause, and the note says which capture it was.
    notes = _notes(info.value)
    assert "task group" in notes and "'misnamed'" in notes
    assert engine.capture_stream.capturing is None  # abandoned: the stream captures no more


def test_an_error_inside_the_sims_graph_context_propagates_as_itself() -> None:
    g, s = torch.npu.NPUGraph(), torch.npu.Stream()
    with pytest.raises(KeyError, match="the author's"), torch.npu.graph(g, stream=s):
        torch.npu.graph_task_group_begin(s)
        torch.zeros(2, device="npu").add_(1)
        raise KeyError("the author's")
    assert not s.capturing and not g.captured


def test_an_error_inside_a_task_update_propagates_as_itself_and_ends_the_update() -> None:
    backend = NpuBackend(torch_npu, 0)
    s, u = backend.new_stream(), backend.new_stream()
    q, k, v, out, other = (backend.empty(shape, torch.float16) for shape in
                           [(1, 2, 1, 8), (1, 2, 16, 8), (1, 2, 16, 8), (1, 2, 1, 8), (1, 2, 1, 8)])
    lse = backend.empty((1,), torch.float32)
    for t in (q, k, v):
        t.zero_()

    def fia(lengths: list[int], into: torch.Tensor) -> tuple[tuple[()], dict[str, object]]:
        return (), {"query": q, "key": k, "value": v, "actual_seq_lengths_kv": lengths,
                    "num_heads": 2, "input_layout": "BNSD", "scale": 0.25, "out": [into, lse]}

    g = backend.new_graph()
    with backend.capture(g, s):
        backend.task_group_begin(s)
        backend.call(FIA, *fia([16], out))
        handle = backend.task_group_end(s)
    # Another op than the captured one (the functional overload): CANN refuses the update.
    functional = {k: a for k, a in fia([8], other)[1].items() if k != "out"}
    with pytest.raises(SimUsageError, match="does not match") as info:
        backend.patch(u, handle, "npu_fused_infer_attention_score", (), functional)
    assert "re-issued" in _notes(info.value)  # ending the abandoned update complained too
    # The update was ended: the stream can update the group again.
    backend.patch(u, handle, FIA, *fia([8], out))
    backend.synchronize()


def _cause(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_a_start_failure_is_permanent_unless_its_cause_may_pass() -> None:
    try:
        try:
            import torch_npu_is_not_installed  # type: ignore[import-not-found]  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("backend 'npu' needs torch_npu\n(pip install)") from exc
    except RuntimeError as exc:
        missing = start_failure(exc)
    assert isinstance(missing, pipe.Failed) and missing.permanent
    assert missing.message == "RuntimeError: backend 'npu' needs torch_npu (pip install)"
    assert "torch_npu_is_not_installed" in missing.traceback  # the chain, in full
    assert start_failure(_cause(ValueError("torch_npu has no op 'mm'"))).permanent
    assert not start_failure(_cause(InjectedDeviceFault("the device failed"))).permanent
    assert not start_failure(_cause(torch.OutOfMemoryError("NPU out of memory"))).permanent
    try:
        try:
            raise InjectedDeviceFault("the device failed")
        except InjectedDeviceFault as exc:
            raise RuntimeError("capture failed") from exc
    except RuntimeError as exc:
        assert not start_failure(exc).permanent  # a device fault anywhere in its causes
