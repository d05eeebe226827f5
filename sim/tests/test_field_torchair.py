"""torchair's reduce-overhead (ACL graph) decode over a paged KV cache, on the sim.

Reproduced from how torchair orders its calls (Ascend/torchair,
python/torchair/_acl_concrete_graph/acl_graph.py: ``AclGraph.compile/capture/process_input``
and ``CapturedGraphUpdateAndReplay.forward``; fx2acl_converter.py:
``_codegen_fx_forward_updated_ops``; ``replace_dynamic_workspace_ops`` for the ``.out``
rewrite). Written here, not copied; the only line that differs from NPU code is the
``torch_npu`` import.

* compile: warm-up runs eagerly and synchronizes; an empty capture initialises the pool;
  the capture runs on the default capture stream (``stream=None``).
* each FIA node becomes ``_npu_fused_infer_attention_score_get_max_workspace`` + two
  ``torch.empty`` outputs + ``npu_fused_infer_attention_score.out``; the ``.out`` call is
  bracketed by an ExternalEvent ``wait``/``reset`` and ``graph_task_group_begin/end`` on
  the capturing stream, and its args, kwargs, handle, event and ``get_stream_limit`` are
  kept.
* each call: copy the inputs into the captured ones (``_foreach_copy_``), replay on the
  current stream, then on one class-wide update stream (priority -1, never the replay
  stream): wait a plain Event recorded on the current stream after the previous call,
  and per node ``set_stream_limit``, ``graph_task_update_begin``, the ``.out`` op with the
  new ``actual_seq_lengths_kv``, ``graph_task_update_end``, ``stream.record_event(event)``;
  last, record that Event on the current stream.

The pre-replay wait on the update stream is the fence torchair added in a60125d5 ("bugfix
for ops update and replay in mtp2 cases"): with two calls per step and no host
synchronization between them (speculative decoding), the second call's patches race the
first call's replay without it. The tests run that MTP pattern for 20 steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from npusim import HazardError, torch_npu
from paged_reference import (
    BS,
    HKV,
    LAYERS,
    NKV,
    SCALE,
    B,
    H,
    N,
    RefDecoder,
    StepInput,
    Weights,
    assert_close,
    make_weights,
)

# torchair's compile captures an empty graph to set up the pool: the empty-graph warning
# (torch's wording, which upstream's test_npu.py expects) is its expected outcome here.
pytestmark = pytest.mark.filterwarnings("ignore:The NPU Graph is empty")

STEPS = 20
FIA_OUT = torch.ops.npu.npu_fused_infer_attention_score.out
FIA_WS = torch.ops.npu._npu_fused_infer_attention_score_get_max_workspace.default


@dataclass
class UpdatedNodeInfo:
    node_name: str
    updated_func: Callable[..., Any]
    updated_param_name: list[str]
    args: list[Any]
    kwargs: dict[str, Any]
    handle: Any
    event: Any
    core: dict[str, int]


class UpdateAndReplay:
    """What torchair runs per call after the graph is captured."""

    update_stream: Any = None

    def __init__(self, graph: Any, infos: list[UpdatedNodeInfo], fence: bool) -> None:
        self.graph, self.infos, self.fence = graph, infos, fence
        if UpdateAndReplay.update_stream is None:
            UpdateAndReplay.update_stream = torch.npu.Stream(priority=-1)
        self.replayed = torch.npu.Event()

    def __call__(self, lens: list[int]) -> None:
        self.graph.replay()
        while UpdateAndReplay.update_stream.stream_id == torch.npu.current_stream().stream_id:
            UpdateAndReplay.update_stream = torch.npu.Stream(priority=-1)
        params = {info.node_name: {"actual_seq_lengths_kv": list(lens)} for info in self.infos}
        u = UpdateAndReplay.update_stream
        with torch.npu.stream(u):
            if self.fence:
                u.wait_event(self.replayed)
            for info in self.infos:
                torch.npu.set_stream_limit(u, info.core["cube_core_num"],
                                           info.core["vector_core_num"])  # fmt: skip
                torch.npu.graph_task_update_begin(u, info.handle)
                kwargs = dict(info.kwargs)
                for key in info.updated_param_name:
                    kwargs[key] = params[info.node_name][key]
                info.updated_func(*info.args, **kwargs)
                torch.npu.graph_task_update_end(u)
                u.record_event(info.event)
        self.replayed.record(torch.npu.current_stream())


class TorchairDecode:
    """The decoder as torchair's generated forward would run it, captured on first call."""

    def __init__(self, w: Weights, clone_input: bool = False, fence: bool = True) -> None:
        self.wq, self.wk, self.wv, self.wo = (
            [t.npu() for t in ts] for ts in (w.wq, w.wk, w.wv, w.wo)
        )
        self.kc = [c.npu() for c in w.kc]
        self.vc = [c.npu() for c in w.vc]
        self.clone_input, self.fence = clone_input, fence
        self.graph: Any = None
        self.static: list[torch.Tensor] = []
        self.outputs: torch.Tensor | None = None
        self.replay: UpdateAndReplay | None = None

    # ------------------------------------------------------------ the generated forward
    def fx_forward(self, x: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
                   lens: list[int], node_info: list[UpdatedNodeInfo] | None = None,
                   is_capturing: bool = False) -> torch.Tensor:  # fmt: skip
        for layer in range(LAYERS):
            q = (x @ self.wq[layer]).view(B, 1, H)
            k, v = x @ self.wk[layer], x @ self.wv[layer]
            self.kc[layer].view(-1, HKV).index_copy_(0, slots, k)
            self.vc[layer].view(-1, HKV).index_copy_(0, slots, v)
            kwargs: dict[str, Any] = dict(
                block_table=table, actual_seq_lengths_kv=list(lens), num_heads=N,
                num_key_value_heads=NKV, scale=SCALE, input_layout="BSH", block_size=BS,
            )  # fmt: skip
            args = [q, self.kc[layer], self.vc[layer]]
            kwargs["workspace"] = FIA_WS(*args, **kwargs)
            kwargs["out"] = [torch.empty(B, 1, H, dtype=torch.float16, device="npu"),
                             torch.empty(1, dtype=torch.float32, device="npu")]  # fmt: skip
            if is_capturing:
                event = torch.npu.ExternalEvent()
                stream = torch.npu.current_stream()
                event.wait(stream)
                event.reset(stream)
                torch.npu.graph_task_group_begin(stream)
            attn, _ = FIA_OUT(*args, **kwargs)
            if is_capturing:
                assert node_info is not None
                handle = torch.npu.graph_task_group_end(stream)
                node_info.append(UpdatedNodeInfo(
                    f"fia_{layer}", FIA_OUT, ["actual_seq_lengths_kv"], args, kwargs, handle,
                    event, torch.npu.get_stream_limit(torch.npu.current_stream()),
                ))  # fmt: skip
            x = attn.view(B, H) @ self.wo[layer]
        return x

    # ------------------------------------------------------------ AclGraph.__call__
    def __call__(self, x: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
                 lens: list[int]) -> torch.Tensor:  # fmt: skip
        user = [x, slots, table]
        if self.graph is None:
            self.fx_forward(*user, lens)  # warm-up (num_warmup_iters=1)
            torch.npu.synchronize()
            with torch_npu.npu.graph(torch_npu.npu.NPUGraph()):
                pass  # initialises the graph pool
            self.graph = torch_npu.npu.NPUGraph()
            infos: list[UpdatedNodeInfo] = []
            with torch_npu.npu.graph(self.graph, capture_error_mode="global"):
                # clone_input (torchair's default): capture reads fresh buffers that the
                # inputs are copied into before every replay
                self.static = [torch.empty_like(t) for t in user] if self.clone_input else user
                self.outputs = self.fx_forward(*self.static, lens, node_info=infos,
                                               is_capturing=True)  # fmt: skip
            self.replay = UpdateAndReplay(self.graph, infos, self.fence)
        dst = [s for s, u in zip(self.static, user, strict=True) if s.data_ptr() != u.data_ptr()]
        src = [u for s, u in zip(self.static, user, strict=True) if s.data_ptr() != u.data_ptr()]
        if dst:
            torch._foreach_copy_(dst, src, non_blocking=True)
        assert self.replay is not None and self.outputs is not None
        self.replay(lens)
        return self.outputs


def mtp_step(
    model: TorchairDecode, step: int
) -> tuple[StepInput, StepInput, torch.Tensor, torch.Tensor]:
    """Two calls without a host synchronization between them (main model, then the
    draft position); the first result is kept on the device. Both calls' inputs are
    uploaded first: a blocking host-to-device copy synchronizes the current stream (as
    torch_npu's does), which would order the second call after the first replay."""
    a = StepInput.make(1000 + step)
    b = StepInput.make(2000 + step, table=a.table, lens=[min(n + 1, 4 * BS) for n in a.lens])
    on_device = [(s.x.npu(), s.slots.npu(), s.table.npu()) for s in (a, b)]
    first = model(*on_device[0], a.lens).clone()
    second = model(*on_device[1], b.lens)
    return a, b, first, second


def run_steps(model: TorchairDecode, ref: RefDecoder) -> None:
    for step in range(STEPS):
        a, b, first, second = mtp_step(model, step)
        assert_close(first.cpu(), ref.forward(a), (step, "first"))
        assert_close(second.cpu(), ref.forward(b), (step, "second"))


def test_torchair_update_after_replay_two_calls_per_step() -> None:
    """clone_input=False: the capture reads the caller's own input tensors."""
    w = make_weights(11)
    run_steps(TorchairDecode(w), RefDecoder(w))


def test_torchair_default_clone_input_path() -> None:
    w = make_weights(12)
    run_steps(TorchairDecode(w, clone_input=True), RefDecoder(w))


def test_torchair_without_the_update_stream_wait_is_reported(watchdog_off: None) -> None:
    """Mutation: torchair before a60125d5. The second call's patches are not ordered
    after the first call's replay."""
    model = TorchairDecode(make_weights(13), fence=False)
    with pytest.raises(HazardError) as caught:
        for step in range(3):
            mtp_step(model, step)
        torch.npu.synchronize()
    # Both are what the missing fence allows: the patch of a layer while the previous
    # replay reads it, and its event's record before that replay consumed the last one.
    assert caught.value.kind in ("race", "lost-release"), caught.value


def test_torchair_default_clone_input_path_without_the_update_stream_wait_is_reported(
    watchdog_off: None,
) -> None:
    """The clone_input path's mutation: with the allocations no longer tasks, the
    missing fence is still what is reported."""
    model = TorchairDecode(make_weights(14), clone_input=True, fence=False)
    with pytest.raises(HazardError) as caught:
        for step in range(3):
            mtp_step(model, step)
        torch.npu.synchronize()
    assert caught.value.kind in ("race", "lost-release"), caught.value
