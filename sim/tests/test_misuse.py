"""Misuse of the simulated NPU's graph API: every rule breaks with SimUsageError at the call.

Each test sets up a legal state, then asserts ``pytest.raises(SimUsageError)`` around the
one call that breaks the rule. The last test checks that the device is still usable after
all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from npusim import SimUsageError, UpdateKeyIgnoredWarning, torch_npu
from npusim.graphs import NPUGraph
from npusim.streams import Stream
from npusim.task_groups import TaskGroupHandle

BATCH, HEADS, S_KV, HEAD_DIM = 1, 2, 16, 8
FIA_KW: dict[str, object] = {
    "num_heads": HEADS,
    "input_layout": "BNSD",
    "scale": 0.25,
    "softmax_lse_flag": False,
}


def _randn(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # float16: the NPU's fused attention takes float16, bfloat16 and int8
    t: torch.Tensor = torch.randn(*shape, generator=gen).to(torch.float16).npu()
    return t


@dataclass
class Fia:
    """The tensors of one fused infer attention call (BNSD, query S = 1)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor

    def issue(self, lengths_kv: list[int], **tensors: torch.Tensor) -> None:
        """Issue ``npu_fused_infer_attention_score.out`` on the current stream.

        ``tensors`` replaces query/key/value/out by name (to re-issue with other tensors).
        """
        t = {"query": self.query, "key": self.key, "value": self.value, "out": self.out}
        t.update(tensors)
        torch_npu.npu_fused_infer_attention_score.out(
            t["query"],
            t["key"],
            t["value"],
            actual_seq_lengths_kv=lengths_kv,
            out=[t["out"], self.lse],
            **FIA_KW,
        )


def make_fia(seed: int = 0) -> Fia:
    return Fia(
        query=_randn(BATCH, HEADS, 1, HEAD_DIM, seed=seed),
        key=_randn(BATCH, HEADS, S_KV, HEAD_DIM, seed=seed + 1),
        value=_randn(BATCH, HEADS, S_KV, HEAD_DIM, seed=seed + 2),
        out=torch.empty(BATCH, HEADS, 1, HEAD_DIM, dtype=torch.float16, device="npu"),
        lse=torch.empty(1, device="npu"),
    )


@dataclass
class Captured:
    """A graph whose one task group holds ``len(fias)`` fused ops."""

    graph: NPUGraph
    stream: Stream
    handle: TaskGroupHandle
    fias: list[Fia] = field(default_factory=list)


def capture_group(n_ops: int = 1) -> Captured:
    fias = [make_fia(seed=10 * i) for i in range(n_ops)]
    g = torch.npu.NPUGraph()
    s = torch.npu.Stream()
    with torch.npu.graph(g, stream=s):
        torch.npu.graph_task_group_begin(s)
        for fia in fias:
            fia.issue([S_KV])
        handle = torch.npu.graph_task_group_end(s)
    return Captured(g, s, handle, fias)


# ------------------------------------------------------------------ task groups (capture)
@pytest.mark.filterwarnings("ignore:The NPU Graph is empty")  # nothing captured
def test_group_begin_and_end_on_different_streams() -> None:
    fia = make_fia()
    g, g_other = torch.npu.NPUGraph(), torch.npu.NPUGraph()
    s, other = torch.npu.Stream(), torch.npu.Stream()
    with torch.npu.graph(g, stream=s):
        torch.npu.graph_task_group_begin(s)
        fia.issue([S_KV])
        with torch.npu.stream(other):
            g_other.capture_begin()  # the other stream captures too: only the stream differs
            with pytest.raises(SimUsageError):
                torch.npu.graph_task_group_end(other)
            g_other.capture_end()
        torch.npu.graph_task_group_end(s)  # the group is still open on s


def test_nested_group_begin() -> None:
    fia = make_fia()
    g, s = torch.npu.NPUGraph(), torch.npu.Stream()
    with torch.npu.graph(g, stream=s):
        torch.npu.graph_task_group_begin(s)
        with pytest.raises(SimUsageError):
            torch.npu.graph_task_group_begin(s)
        fia.issue([S_KV])
        torch.npu.graph_task_group_end(s)


def test_group_begin_on_stream_not_capturing() -> None:
    s = torch.npu.Stream()
    with pytest.raises(SimUsageError):
        torch.npu.graph_task_group_begin(s)


def test_capture_end_with_open_group() -> None:
    fia = make_fia()
    g, s = torch.npu.NPUGraph(), torch.npu.Stream()
    with torch.npu.stream(s):
        g.capture_begin()
        torch.npu.graph_task_group_begin(s)
        fia.issue([S_KV])
        with pytest.raises(SimUsageError):
            g.capture_end()
    assert not torch.npu.is_current_stream_capturing()


@pytest.mark.filterwarnings("ignore:The NPU Graph is empty")  # nothing captured
def test_empty_task_group() -> None:
    g, s = torch.npu.NPUGraph(), torch.npu.Stream()
    with torch.npu.graph(g, stream=s):
        torch.npu.graph_task_group_begin(s)
        with pytest.raises(SimUsageError):
            torch.npu.graph_task_group_end(s)


def test_capture_on_default_stream() -> None:
    g = torch.npu.NPUGraph()
    with torch.npu.stream(torch.npu.default_stream()):
        assert torch.npu.current_stream() is torch.npu.default_stream()
        with pytest.raises(SimUsageError):
            g.capture_begin()
    assert not torch.npu.default_stream().capturing


# ------------------------------------------------------------------ task group updates
def test_update_begin_on_stream_capturing_another_graph() -> None:
    cap = capture_group()
    g2, s2 = torch.npu.NPUGraph(), torch.npu.Stream()
    x = torch.zeros(4, device="npu")
    with torch.npu.graph(g2, stream=s2):
        x.add_(1)
        with pytest.raises(SimUsageError):
            torch.npu.graph_task_update_begin(s2, cap.handle)


def test_update_begin_with_handle_of_reset_graph() -> None:
    cap = capture_group()
    cap.graph.reset()
    u = torch.npu.Stream()
    with pytest.raises(SimUsageError):
        torch.npu.graph_task_update_begin(u, cap.handle)


def test_update_end_without_begin() -> None:
    u = torch.npu.Stream()
    with pytest.raises(SimUsageError):
        torch.npu.graph_task_update_end(u)


def test_nested_update_begin_on_same_stream() -> None:
    cap = capture_group()
    u = torch.npu.Stream()
    with torch.npu.stream(u):
        torch.npu.graph_task_update_begin(u, cap.handle)
        with pytest.raises(SimUsageError):
            torch.npu.graph_task_update_begin(u, cap.handle)
        cap.fias[0].issue([8])
        torch.npu.graph_task_update_end(u)


def test_update_end_after_fewer_ops_than_the_group_holds() -> None:
    cap = capture_group(n_ops=2)
    u = torch.npu.Stream()
    with torch.npu.stream(u):
        torch.npu.graph_task_update_begin(u, cap.handle)
        cap.fias[0].issue([8])
        with pytest.raises(SimUsageError):
            torch.npu.graph_task_update_end(u)


def test_update_reissues_a_different_op() -> None:
    cap = capture_group()
    u = torch.npu.Stream()
    x = torch.zeros(4, device="npu")
    y = torch.zeros(4, device="npu")
    with torch.npu.stream(u):
        torch.npu.graph_task_update_begin(u, cap.handle)
        with pytest.raises(SimUsageError):
            torch.add(x, 1, out=y)
        cap.fias[0].issue([8])  # the update can still be completed
        torch.npu.graph_task_update_end(u)


def test_update_reissues_op_with_another_tensor_of_same_shape() -> None:
    cap = capture_group()
    fia = cap.fias[0]
    other_key = _randn(*fia.key.shape, seed=99)
    assert other_key.shape == fia.key.shape
    assert other_key.data_ptr() != fia.key.data_ptr()
    u = torch.npu.Stream()
    with torch.npu.stream(u):
        torch.npu.graph_task_update_begin(u, cap.handle)
        with pytest.raises(SimUsageError):
            fia.issue([8], key=other_key)


def test_update_reissues_op_with_tensor_of_another_shape() -> None:
    cap = capture_group()
    fia = cap.fias[0]
    longer_key = _randn(BATCH, HEADS, 2 * S_KV, HEAD_DIM, seed=98)
    longer_value = _randn(BATCH, HEADS, 2 * S_KV, HEAD_DIM, seed=97)
    u = torch.npu.Stream()
    with torch.npu.stream(u):
        torch.npu.graph_task_update_begin(u, cap.handle)
        with pytest.raises(SimUsageError):
            fia.issue([8], key=longer_key, value=longer_value)


def test_replay_of_graph_never_captured() -> None:
    g = torch.npu.NPUGraph()
    with pytest.raises(SimUsageError):
        g.replay()


def test_replay_after_reset() -> None:
    cap = capture_group()
    cap.graph.replay()
    torch.npu.synchronize()
    cap.graph.reset()
    with pytest.raises(SimUsageError):
        cap.graph.replay()


# ------------------------------------------------------------------ ExternalEvent
def test_external_event_wait_twice_without_record() -> None:
    ev = torch.npu.ExternalEvent()
    a, b = torch.npu.Stream(), torch.npu.Stream()
    ev.wait(a)
    with pytest.raises(SimUsageError):
        ev.wait(a)
    ev.record(b)  # releases the first wait
    torch.npu.synchronize()


# ------------------------------------------------------------------ NPUGraph.update
def _capture_auto_dispatch() -> tuple[NPUGraph, Fia]:
    fia = make_fia()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        fia.issue([S_KV])
    return g, fia


def test_graph_update_without_auto_dispatch_capture() -> None:
    cap = capture_group()
    with pytest.raises(SimUsageError):
        cap.graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [8]}])


def test_graph_update_with_wrong_length_input() -> None:
    g, _ = _capture_auto_dispatch()
    updates: list[dict[str, object]] = [
        {"actual_seq_lengths_kv": [8]},
        {"actual_seq_lengths_kv": [4]},
    ]
    with pytest.raises(SimUsageError):
        g.update(cpu_update_input=updates)


def test_graph_update_with_unknown_key() -> None:
    """torch_npu drops a key the captured call did not pass; the sim warns as well."""
    g, _ = _capture_auto_dispatch()
    with pytest.warns(UpdateKeyIgnoredWarning, match="no_such_argument"):
        g.update(cpu_update_input=[{"no_such_argument": 1}])


# ------------------------------------------------------------------ capture isolation
def test_host_read_while_current_stream_captures() -> None:
    x = torch.ones(4, device="npu")
    g, s = torch.npu.NPUGraph(), torch.npu.Stream()
    with torch.npu.graph(g, stream=s):
        x.mul_(2)
        with pytest.raises(SimUsageError):
            x.cpu()


def test_event_wait_in_capture_for_event_recorded_outside() -> None:
    ev = torch.npu.Event()
    ev.record(torch.npu.Stream())
    g, s = torch.npu.NPUGraph(), torch.npu.Stream()
    x = torch.ones(4, device="npu")
    with torch.npu.graph(g, stream=s):
        with pytest.raises(SimUsageError):
            ev.wait(s)
        x.mul_(2)


# ------------------------------------------------------------------ fused op arguments
def test_fused_op_num_heads_not_matching_query() -> None:
    fia = make_fia()
    with pytest.raises(SimUsageError):
        torch_npu.npu_fused_infer_attention_score.out(
            fia.query,
            fia.key,
            fia.value,
            num_heads=HEADS + 1,
            input_layout="BNSD",
            scale=0.25,
            out=[fia.out, fia.lse],
        )


def test_fused_op_kv_length_longer_than_key() -> None:
    fia = make_fia()
    with pytest.raises(SimUsageError):
        fia.issue([S_KV + 1])


# ------------------------------------------------------------------ still usable
def test_device_usable_after_misuse() -> None:
    """Runs last in this module: eager work, capture, update and replay still succeed."""
    x = torch.arange(4, dtype=torch.float32).npu()
    assert torch.equal((x + 1).cpu(), torch.arange(1, 5, dtype=torch.float32))

    fia = make_fia()
    g, s, u = torch.npu.NPUGraph(), torch.npu.Stream(), torch.npu.Stream()
    ext = torch.npu.ExternalEvent()
    y = torch.zeros(4, device="npu")
    with torch.npu.graph(g, stream=s):
        y.copy_(x * 3)
        ext.wait(s)
        torch.npu.graph_task_group_begin(s)
        fia.issue([S_KV])
        handle = torch.npu.graph_task_group_end(s)
    with torch.npu.stream(u):
        torch.npu.graph_task_update_begin(u, handle)
        fia.issue([5])
        torch.npu.graph_task_update_end(u)
        ext.record(u)
    g.replay()
    torch.npu.synchronize()
    assert torch.equal(y.cpu(), torch.arange(4, dtype=torch.float32) * 3)
    expected, _ = torch_npu.npu_fused_infer_attention_score(
        fia.query, fia.key, fia.value, actual_seq_lengths_kv=[5], **FIA_KW
    )
    assert torch.equal(fia.out.cpu(), expected.cpu())
