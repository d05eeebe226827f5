# ruff: noqa: RUF001  (a doc in the wheel's style: full-width punctuation)
"""What an A2 under torch_npu 2.14 can run (npusim.opsupport) and what a captured graph
costs (npusim.graph_profile): refusals with torch_npu's words, AI CPU tasks counted,
float32 fused attention only as the sim's named extension."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import npusim
import pytest
import torch
from npusim import SimUsageError, extensions, opsupport, torch_npu
from npusim.tensor import backend_op_names


def _profiled_graph() -> tuple[Any, torch.Tensor, torch.Tensor]:
    host_in = torch.arange(16, dtype=torch.int64).pin_memory()
    host_out = torch.zeros(16, dtype=torch.int64).pin_memory()
    x = torch.zeros(16, dtype=torch.int64, device="npu")
    s, g = torch.npu.Stream(), torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        x.copy_(host_in, non_blocking=True)  # H2D
        y = x >> 3  # aclnnRightShift: an AI CPU kernel on an A2
        z = (y + x) * 2  # two AI Core kernels
        w = torch.empty_like(z)
        w.copy_(z)  # D2D
        host_out.copy_(w, non_blocking=True)  # D2H
    return g, host_in, host_out


def test_a_captured_graphs_profile_counts_its_tasks_by_kind_and_op() -> None:
    g, host_in, host_out = _profiled_graph()
    p = npusim.graph_profile(g)
    assert dict(p.kernels) == {"add.Tensor": 1, "mul.Tensor": 1}
    assert dict(p.aicpu) == {"__rshift__.Scalar": 1}
    assert dict(p.memcpy) == {"D2D": 1, "D2H": 1, "H2D": 1}
    assert (p.kernel_count, p.aicpu_count, p.memcpy_count, p.host_syncs) == (2, 1, 3, 0)
    assert p.extensions == frozenset()
    text = str(p)
    assert "2 device kernels, 1 AI CPU tasks, 3 memcpys, 0 host syncs" in text
    assert "AI CPU:  __rshift__.Scalar x1" in text
    g.replay()
    torch.npu.synchronize()
    assert torch.equal(host_out, ((host_in >> 3) + host_in) * 2)


def test_the_profile_counts_side_stream_branches_and_event_tasks() -> None:
    x = torch.ones(8, dtype=torch.int64, device="npu")
    s, side, g = torch.npu.Stream(), torch.npu.Stream(), torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        a = x + x
        side.wait_stream(s)  # fork: a record on s, a wait on side
        with torch.npu.stream(side):
            b = x >> 1  # on the branch
        s.wait_stream(side)  # join: a record on side, a wait on s
        out = a + b
    p = npusim.graph_profile(g)
    assert dict(p.kernels) == {"add.Tensor": 2}
    assert dict(p.aicpu) == {"__rshift__.Scalar": 1}
    assert p.events == 4
    g.replay()
    assert torch.equal(out.cpu(), torch.full((8,), 2))


def test_the_profile_splits_the_capture_streams_tasks_at_its_external_waits() -> None:
    """``stretches``: what a replay runs between the waits where the host releases it
    (a side stream's tasks, and plain event waits, are not the capture stream's)."""
    x = torch.ones(8, dtype=torch.int64, device="npu")
    s, side, g = torch.npu.Stream(), torch.npu.Stream(), torch.npu.NPUGraph()
    evs = [torch.npu.ExternalEvent() for _ in range(2)]
    with torch.npu.graph(g, stream=s):
        a = x + x  # 1 before the first wait
        evs[0].wait(s)
        evs[0].reset(s)
        side.wait_stream(s)
        with torch.npu.stream(side):
            b = x >> 1  # on the branch: not counted
        s.wait_stream(side)
        c = a * 3 + b  # 2 between the waits
        evs[1].wait(s)
        evs[1].reset(s)
    p = npusim.graph_profile(g)
    assert p.stretches == (1, 2, 0)
    for ev in evs:
        ev.record(torch.npu.Stream())
    g.replay()
    assert torch.equal(c.cpu(), torch.full((8,), 6))


def test_right_shift_runs_on_the_ai_cpu_per_the_cann_sources() -> None:
    for name in ("__rshift__.Tensor", "__rshift__.Scalar", "__irshift__.Tensor"):
        sup = opsupport.support_of(getattr(torch.ops.aten, name.split(".")[0]).__getattr__(
            name.split(".")[1]))  # fmt: skip
        assert (sup.path, sup.kernels, sup.unit) == ("aclnn", ("aclnnRightShift",), "aicpu")
    assert not opsupport.support_of(torch.ops.aten.add.Tensor).aicpu


def test_the_table_covers_every_op_the_sim_serves() -> None:
    t = opsupport.table()
    assert set(backend_op_names()) <= set(t["aten"])
    npu_ops = {n.removeprefix("npu::") for n in torch._C._dispatch_get_all_op_names()
               if n.startswith("npu::")}  # fmt: skip
    assert npu_ops <= set(t["npu"])
    assert t["sources"]["Ascend/op-plugin"]["commit"] == "517f2e7d0f202f38b76310706cb977ca2388ad21"
    assert t["torch_npu"]["version"] == "2.14.0"


def test_an_aclop_only_op_is_refused_in_capture_with_torch_npus_words() -> None:
    """slow_conv3d_forward has only an acl_op implementation in op-plugin for v2.14 (no
    opapi file implements it; op_plugin_functions.yaml lists acl_op only). The check
    comes before the sim runs anything of the op (which has no meta kernel in torch)."""
    assert opsupport.support_of(torch.ops.aten.slow_conv3d_forward.default).path == "aclop"
    x, w = torch.randn(1, 1, 3, 3, 3).npu(), torch.randn(1, 1, 2, 2, 2).npu()
    args = (x, w, [2, 2, 2], None, [1, 1, 1], [0, 0, 0])
    s, g = torch.npu.Stream(), torch.npu.NPUGraph()
    with pytest.raises(SimUsageError) as info, torch.npu.graph(g, stream=s):
        torch.ops.aten.slow_conv3d_forward(*args)
    assert str(info.value).startswith(
        "Cannot run aclop operators during NPU graph capture. Current working aclop is "
        "slow_conv3d_forward. If you need this call to be captured, please try to set "
        "torch.npu.config.allow_internal_format = False. If still fail, the operator needs "
        "aclnn implementation and please file an issue. Current npuStreamCaptureStatus: "
        "npuStreamCaptureStatusActive"
    )


def test_task_queue_enable_2_refuses_capture_with_torch_npus_words() -> None:
    code = (
        "import torch\nfrom npusim import torch_npu\n"
        "s, g = torch.npu.Stream(), torch.npu.NPUGraph()\n"
        "try:\n    g.capture_begin()\nexcept Exception as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, TASK_QUEUE_ENABLE="2"),
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert out.stdout.strip() == (
        "Do not support TASK_QUEUE_ENABLE = 2 during NPU graph capture, please export "
        "TASK_QUEUE_ENABLE=1/0."
    )


# ---------------------------------------------------------------- fused attention dtypes
def _fia(dtype: torch.dtype) -> Any:
    q = torch.randn(2, 4, 1, 16).to(dtype).npu()
    kv = torch.randn(2, 4, 8, 16).to(dtype).npu()
    kw = dict(num_heads=4, input_layout="BNSD", scale=0.25)
    return q, kv, kw


def _v1(dtype: torch.dtype) -> None:
    q, kv, kw = _fia(dtype)
    torch_npu.npu_fused_infer_attention_score(q, kv, kv, **kw)


def _v1_out(dtype: torch.dtype) -> None:
    q, kv, kw = _fia(dtype)
    out, lse = torch.empty_like(q), torch.empty(1, device="npu")
    torch_npu.npu_fused_infer_attention_score.out(q, kv, kv, out=[out, lse], **kw)


def _v2(dtype: torch.dtype) -> None:
    q, kv, _ = _fia(dtype)
    torch_npu.npu_fused_infer_attention_score_v2(
        q, kv, kv, num_query_heads=4, input_layout="BNSD", softmax_scale=0.25)  # fmt: skip


def _v2_out(dtype: torch.dtype) -> None:
    q, kv, _ = _fia(dtype)
    out, lse = torch.empty_like(q), torch.empty(1, device="npu")
    torch.ops.npu.npu_fused_infer_attention_score_v2.out(
        q, kv, kv, num_query_heads=4, input_layout="BNSD", softmax_scale=0.25,
        out=[out, lse])  # fmt: skip


def _paged(dtype: torch.dtype) -> None:
    q = torch.randn(2, 4, 16).to(dtype).npu()
    cache = torch.randn(4, 128, 4, 16).to(dtype).npu()
    table = torch.tensor([[0], [1]], dtype=torch.int32).npu()
    lens = torch.tensor([5, 9], dtype=torch.int32)
    out = torch.empty_like(q)
    torch_npu._npu_paged_attention(q, cache, cache, 4, 4, 0.25, table, lens, out)


ATTENTION = {
    "npu_fused_infer_attention_score": _v1,
    "npu_fused_infer_attention_score.out": _v1_out,
    "npu_fused_infer_attention_score_v2": _v2,
    "npu_fused_infer_attention_score_v2.out": _v2_out,
    "_npu_paged_attention": _paged,
}


@pytest.mark.parametrize("op", sorted(ATTENTION))
def test_float32_fused_attention_is_refused_unless_the_extension_is_on(op: str) -> None:
    ATTENTION[op](torch.float16)
    ATTENTION[op](torch.bfloat16)
    with pytest.raises(SimUsageError, match=rf"^{op}: query is float32, which torch_npu 2\.14 "
                       r"on an Atlas A2 does not accept: it takes bfloat16, float16, int8 .*"
                       r"float32_attention"):  # fmt: skip
        ATTENTION[op](torch.float32)
    with extensions.enabled("float32_attention"):
        ATTENTION[op](torch.float32)


def test_the_profile_names_the_extension_a_graph_used() -> None:
    q, kv, kw = _fia(torch.float32)
    s = torch.npu.Stream()
    plain, extended = torch.npu.NPUGraph(), torch.npu.NPUGraph()
    q16, kv16, _ = _fia(torch.float16)
    with torch.npu.graph(plain, stream=s):
        torch_npu.npu_fused_infer_attention_score(q16, kv16, kv16, **kw)
    with extensions.enabled("float32_attention"), torch.npu.graph(extended, stream=s):
        torch_npu.npu_fused_infer_attention_score(q, kv, kv, **kw)
    assert npusim.graph_profile(plain).extensions == frozenset()
    p = npusim.graph_profile(extended)
    assert p.extensions == {"float32_attention"}
    assert dict(p.kernels) == {"npu_fused_infer_attention_score": 1}
    assert "sim extensions used (not the NPU's): float32_attention" in str(p)


# ---------------------------------------------------------------- the generator's parsers
def _generator() -> Any:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gen_op_support.py"
    spec = importlib.util.spec_from_file_location("gen_op_support", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generator_reads_argument_rules_and_version_specs() -> None:
    gen = _generator()
    doc = "\n".join([
        "参数说明:",
        "x (Tensor): 必选参数，数据类型支持torch.float16, torch.bfloat16，不支持非连续的Tensor。",
        "    Atlas A2 训练系列产品: 数据类型支持float16、int8。",
        "scale：Tensor类型，数据类型与x一致。",
        "-   idx（Tensor）：可选参数，数据类型支持int32和int64，支持非连续Tensor，数据格式支持ND。",
        "约束说明:",
        "x: 数据类型支持float32。",
    ])  # fmt: skip
    rules = gen.argument_rules(doc, ["x", "scale", "idx"])
    assert rules == {
        "x": {"dtypes": ["float16", "int8"], "contiguous": True, "formats": None},
        "scale": {"dtypes": None, "contiguous": None, "formats": None},
        "idx": {"dtypes": ["int32", "int64"], "contiguous": False, "formats": ["ND"]},
    }
    assert gen.in_version("all_version", "v2.14")
    assert gen.in_version(["v2.1", "newest"], "v2.14")
    assert not gen.in_version(["v2.1", "v2.12"], "v2.14")
    assert not gen.in_version("v2.1, v2.2", "v2.14")
