"""The sim's short paths check what the dispatcher's path checks.

A captured task's tensor keys are taken at capture and a patch is compared with
them (the same layouts; addresses may change); the fused update binding binds its
arguments itself and never takes torch's dispatcher (as on the NPU). Each test here is
a way such a shortcut could let a wrong patch through or change a result.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from npusim import SimUsageError, torch_npu
from npusim.task_groups import abandon_update
from torch.utils._python_dispatch import TorchDispatchMode

fused = torch_npu._C._npu_fused_infer_attention_score_out_graph
fia = torch_npu.npu_fused_infer_attention_score
B, N, NKV, D, KV = 2, 4, 2, 8, 16


class Layer:
    """One captured attention task group behind an ExternalEvent."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.q_cpu = torch.randn(B, N, 1, D, dtype=torch.float16, generator=g)
        self.kv_cpu = torch.randn(B, NKV, KV, D, dtype=torch.float16, generator=g)
        self.q, self.kv = self.q_cpu.npu(), self.kv_cpu.npu()
        self.out = torch.zeros(B, N, 1, D, dtype=torch.float16, device="npu")
        self.lse = torch.zeros(1, device="npu")
        self.s, self.u = torch.npu.Stream(), torch.npu.Stream()
        self.ev = torch.npu.ExternalEvent()
        self.graph = torch.npu.NPUGraph()
        with torch.npu.graph(self.graph, stream=self.s):
            self.ev.wait(self.s)
            torch.npu.graph_task_group_begin(self.s)
            fia.out(**self.args([KV] * B))
            self.handle = torch.npu.graph_task_group_end(self.s)

    def args(self, lengths: list[int], **over: Any) -> dict[str, Any]:
        a = dict(
            query=self.q, key=self.kv, value=self.kv, actual_seq_lengths_kv=lengths,
            num_heads=N, num_key_value_heads=NKV, input_layout="BNSD",
            scale=1 / math.sqrt(D), softmax_lse_flag=False, out=[self.out, self.lse],
        )  # fmt: skip
        a.update(over)
        return a

    def patch(self, lengths: list[int], **over: Any) -> None:
        """The explicit API: begin, the op (through the dispatcher), end, record."""
        with torch.npu.stream(self.u):
            torch.npu.graph_task_update_begin(self.u, self.handle)
            fia.out(**self.args(lengths, **over))
            torch.npu.graph_task_update_end(self.u)
            self.ev.record(self.u)

    def run(self) -> torch.Tensor:
        with torch.npu.stream(self.s):
            self.graph.replay()
        torch.npu.synchronize()
        return self.out.cpu()

    def expected(self, lengths: list[int], **over: Any) -> torch.Tensor:
        out = torch.zeros(B, N, 1, D, dtype=torch.float16)
        a = self.args(lengths, query=self.q_cpu, key=self.kv_cpu, value=self.kv_cpu, **over)
        a["out"] = [out, torch.zeros(1)]
        fia.out(**a)
        return out


def test_fused_binding_patches_as_the_explicit_api_does() -> None:
    layer = Layer()
    fused(layer.u, layer.handle, layer.ev, **layer.args([3, 9]))
    assert torch.equal(layer.run(), layer.expected([3, 9]))
    layer.patch([5, 1])
    assert torch.equal(layer.run(), layer.expected([5, 1]))


def test_a_new_view_with_the_captured_layout_may_patch() -> None:
    layer = Layer()
    out_view = layer.out.view(B, N, 1, D)  # another tensor object, same address and layout
    fused(layer.u, layer.handle, layer.ev, **layer.args([2, 2], out=[out_view, layer.lse]))
    assert torch.equal(layer.run(), layer.expected([2, 2]))


@pytest.mark.parametrize("path", ["fused", "explicit"])
def test_patch_with_another_buffer_of_the_layout_writes_into_it(path: str) -> None:
    """A tensor's address is a task parameter CANN's update replaces: both paths agree."""
    layer = Layer()
    other = torch.zeros_like(layer.out)
    torch.npu.synchronize()  # the replays on another stream write it
    if path == "fused":
        fused(layer.u, layer.handle, layer.ev, **layer.args([1, 1], out=[other, layer.lse]))
    else:
        layer.patch([1, 1], out=[other, layer.lse])
    assert torch.equal(layer.run(), torch.zeros(B, N, 1, D, dtype=torch.float16))
    assert torch.equal(other.cpu(), layer.expected([1, 1]))


@pytest.mark.parametrize("path", ["fused", "explicit"])
def test_patch_with_a_buffer_of_another_shape_is_refused(path: str) -> None:
    layer = Layer()
    longer = torch.zeros(B, NKV, 2 * KV, D, dtype=torch.float16, device="npu")  # a valid call
    with pytest.raises(SimUsageError, match=r"shape/stride/dtype .*another tiling"):
        if path == "fused":
            fused(layer.u, layer.handle, layer.ev, **layer.args([1, 1], key=longer, value=longer))
        else:
            layer.patch([1, 1], key=longer, value=longer)


def test_captured_tensor_whose_layout_changed_in_place_is_refused() -> None:
    """The graph holds the layout of capture time: a patch with the same tensor object,
    restrided in place since, does not match it."""
    layer = Layer()
    layer.out.as_strided_(layer.out.shape, (1, B, B * N, B * N))
    torch.npu.synchronize()
    with pytest.raises(SimUsageError, match="shape/stride/dtype"):
        fused(layer.u, layer.handle, layer.ev, **layer.args([1, 1]))


@pytest.mark.parametrize(
    "over",
    [
        {"actual_seq_lengths_kv": (4, 4)},  # a tuple for a list, as a binding converts it
        {"scale": 1},  # an int for a float
    ],
)
def test_fused_binding_converts_argument_types_as_a_binding_does(
    over: dict[str, Any],
) -> None:
    layer = Layer()
    lengths = list(over.get("actual_seq_lengths_kv", [KV] * B))
    fused(layer.u, layer.handle, layer.ev, **layer.args(lengths, **over))
    scale = float(over.get("scale", 1 / math.sqrt(D)))
    assert torch.equal(layer.run(), layer.expected(lengths, scale=scale))


def test_fused_binding_with_an_out_of_range_length_is_refused_at_issue() -> None:
    layer = Layer()
    with pytest.raises(SimUsageError, match="actual_seq_lengths_kv"):
        fused(layer.u, layer.handle, layer.ev, **layer.args([KV + 1, 1]))


def test_fused_binding_with_a_host_tensor_is_refused() -> None:
    """A host tensor where the capture had a device tensor: refused, naming it."""
    layer = Layer()
    with pytest.raises(SimUsageError, match="'key'"):
        fused(layer.u, layer.handle, layer.ev, **layer.args([1, 1], key=layer.kv_cpu))
    with pytest.raises(SimUsageError, match="'out'"):
        fused(layer.u, layer.handle, layer.ev, **layer.args([1, 1], out=[layer.q_cpu, layer.lse]))
    fused(layer.u, layer.handle, layer.ev, **layer.args([2, 5]))  # the update stream is free
    assert torch.equal(layer.run(), layer.expected([2, 5]))


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"num_heads": "4"}, "num_heads"),
        ({"num_heads": True}, "num_heads"),
        ({"actual_seq_lengths_kv": [1.0, 2.0]}, "actual_seq_lengths_kv"),
        ({"no_such_argument": 1}, "no_such_argument"),
        ({"query": None}, "query"),
    ],
)
def test_fused_binding_refuses_what_does_not_bind_naming_the_argument(
    over: dict[str, Any], named: str
) -> None:
    """As the NPU's C++ binding: a TypeError naming the argument, never a conversion by
    torch's dispatcher; the update is closed, so the stream can update again."""
    layer = Layer()
    with pytest.raises(TypeError, match=named):
        fused(layer.u, layer.handle, layer.ev, **layer.args([1, 1], **over))
    args = layer.args([1, 1])
    with pytest.raises(TypeError, match="query"):
        fused(layer.u, layer.handle, layer.ev, args.pop("query"), query=layer.q, **args)
    fused(layer.u, layer.handle, layer.ev, **layer.args([3, 3]))
    assert torch.equal(layer.run(), layer.expected([3, 3]))


def test_fused_binding_binds_positional_arguments_in_schema_order() -> None:
    layer = Layer()
    args = layer.args([4, 2])
    q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
    fused(layer.u, layer.handle, layer.ev, q, k, v, **args)
    assert torch.equal(layer.run(), layer.expected([4, 2]))


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.funcs: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_fused_binding_is_not_seen_by_an_active_dispatch_mode() -> None:
    """A C++ binding on the NPU: torch's dispatch modes do not see it."""
    layer = Layer()
    with _Seen() as mode:
        fused(layer.u, layer.handle, layer.ev, **layer.args([2, 3]))
    assert fia.out not in mode.funcs
    assert torch.equal(layer.run(), layer.expected([2, 3]))


def test_a_fused_call_does_not_take_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """No call reaches the npu tensor's __torch_dispatch__ (the binding once stopped
    applying when the op's schema came to return its out tensors, and every patch
    silently took the dispatcher's path), whatever its argument types."""
    from npusim.tensor import NpuTensor

    seen: list[Any] = []
    through = NpuTensor.__torch_dispatch__.__func__  # type: ignore[attr-defined]

    def spy(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        seen.append(func)
        return through(cls, func, types, args, kwargs)

    layer = Layer()
    monkeypatch.setattr(NpuTensor, "__torch_dispatch__", classmethod(spy))
    fused(layer.u, layer.handle, layer.ev, **layer.args([2, 3]))
    assert fia.out not in seen
    assert torch.equal(layer.run(), layer.expected([2, 3]))
    fused(layer.u, layer.handle, layer.ev, **layer.args([4, 1], scale=1))  # an int for a float
    assert fia.out not in seen
    assert torch.equal(layer.run(), layer.expected([4, 1], scale=1.0))


def test_patch_keys_of_a_list_the_caller_mutates_afterwards_are_those_of_issue() -> None:
    layer = Layer()
    lengths = [6, 7]
    fused(layer.u, layer.handle, layer.ev, **layer.args(lengths))
    lengths[0] = 1  # the patch took its values when it was issued
    assert torch.equal(layer.run(), layer.expected([6, 7]))


@pytest.mark.parametrize("path", ["fused", "explicit"])
def test_remembered_check_still_checks_lengths_and_everything_that_changed(path: str) -> None:
    """Arguments that passed once are remembered; a later call that differs in its
    lengths gets the length checks, one that differs in anything else all checks."""
    layer = Layer()

    def patch(lengths: list[int], **over: Any) -> None:
        if path == "fused":
            fused(layer.u, layer.handle, layer.ev, **layer.args(lengths, **over))
        else:
            try:
                layer.patch(lengths, **over)
            finally:
                abandon_update(layer.u)  # after a refusal, the update is still open

    patch([4, 4])
    layer.run()
    for bad, match in [
        (dict(lengths=[KV + 1, 1]), "actual_seq_lengths_kv"),
        (dict(lengths=[-1, 2]), "actual_seq_lengths_kv"),
        (dict(lengths=[1, 1], num_heads=N * 2), "num_heads"),
        (dict(lengths=[1, 1], input_layout="BSH"), "layout BSH"),
        (dict(lengths=[1, 1], softmax_lse_flag=True), "softmax_lse"),
    ]:
        lengths = bad.pop("lengths")
        with pytest.raises(SimUsageError, match=match):
            patch(lengths, **bad)
    patch([2, 3])  # still patches after the refusals
    assert torch.equal(layer.run(), layer.expected([2, 3]))


def test_to_host_forms_copy_as_to_copy_does() -> None:
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).npu()
    for y in (
        x.to("cpu"),
        x.to(torch.device("cpu")),
        x.cpu(),
        x.to("cpu", torch.float64),  # not a fast form: through the dispatcher
        x.to("cpu:0"),
    ):
        assert y.device.type == "cpu"
        assert y.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    late = x.to("cpu", non_blocking=True)
    torch.npu.synchronize()
    assert late.dtype == torch.float32 and late.sum().item() == 15.0
    assert x.t().to("cpu").tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    assert x.to(torch.float64).device.type == "npu"


def test_blocking_copy_to_host_during_capture_is_still_refused() -> None:
    x = torch.ones(2).npu()
    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with pytest.raises(SimUsageError, match="blocking"), torch.npu.graph(g, stream=s):
        x.to("cpu")


def test_a_dispatch_mode_sees_copies_to_the_host() -> None:
    """``x.to("cpu")`` and ``x.cpu()`` skip the dispatcher only while no mode is on: on the
    NPU torch's Tensor.to dispatches ``_to_copy``, and a mode sees it."""
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).npu()
    for copy in (lambda: x.to("cpu"), x.cpu, lambda: x.to("cpu", non_blocking=True)):
        with _Seen() as mode:
            y = copy()
        assert torch.ops.aten._to_copy.default in mode.funcs
        torch.npu.synchronize()
        assert y.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
