"""A MoE decode graph with a shared-expert stream and attention updates, as serving
stacks capture it on the NPU (vllm-ascend's full-decode ACL graph with
``update_attn_params``; DeepSeek-style MoE layers computing the shared expert on a side
stream: fork, compute on both streams, join).

Per layer the graph waits on the layer's ExternalEvent, runs the fused attention in a
task group, forks the shared expert onto a side stream while the routed expert runs on
the capture stream, and joins. Each step patches the attention's kv lengths on an update
stream fenced after the previous replay, then replays; the result must equal the eager
computation for those lengths, on every step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from npusim import SimUsageError, fault, torch_npu

B, N, D, S_MAX, LAYERS = 1, 4, 64, 48, 2
FIA = dict(num_heads=N, input_layout="BNSD", scale=D**-0.5, softmax_lse_flag=False)


class MoEDecode:
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(7)

        def r(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * 0.1).to(torch.float16).npu()

        self.q = r(B, N, 1, D)
        self.k = [r(B, N, S_MAX, D) for _ in range(LAYERS)]
        self.v = [r(B, N, S_MAX, D) for _ in range(LAYERS)]
        self.w_shared = [r(N * D, N * D) for _ in range(LAYERS)]
        self.w_routed = [r(N * D, N * D) for _ in range(LAYERS)]
        self.main, self.side, self.update = (torch.npu.Stream() for _ in range(3))
        self.events = [torch.npu.ExternalEvent() for _ in range(LAYERS)]
        self.done = torch.npu.Event()

    def attention(self, layer: int, x: torch.Tensor, lens: list[int], **out: Any) -> Any:
        op = torch_npu.npu_fused_infer_attention_score
        fn = op.out if out else op
        return fn(x, self.k[layer], self.v[layer], actual_seq_lengths_kv=lens, **FIA, **out)

    def eager(self, lens: list[int]) -> torch.Tensor:
        x = self.q
        for layer in range(LAYERS):
            hidden = self.attention(layer, x, lens)[0].view(B, N * D)
            x = (hidden @ self.w_shared[layer] + hidden @ self.w_routed[layer]).view(B, N, 1, D)
        return x.cpu()

    def capture(self, join: bool = True) -> None:
        ws = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
            self.q, self.k[0], self.v[0], actual_seq_lengths_kv=[S_MAX], **FIA
        )
        self.outs = [
            (torch.empty(B, N, 1, D, dtype=torch.float16, device="npu"),
             torch.empty(1, dtype=torch.float16, device="npu"))
            for _ in range(LAYERS)
        ]  # fmt: skip
        self.ws, self.handles, self.graph = ws, [], torch.npu.NPUGraph()
        self.queries: list[torch.Tensor] = []
        main, side = self.main, self.side
        with torch.npu.graph(self.graph, stream=main):
            x = self.q
            for layer in range(LAYERS):
                self.events[layer].wait(main)
                self.queries.append(x)
                torch.npu.graph_task_group_begin(main)
                o, lse = self.outs[layer]
                self.attention(layer, x, [S_MAX], workspace=ws, out=[o, lse])
                self.handles.append(torch.npu.graph_task_group_end(main))
                hidden = o.view(B, N * D)
                side.wait_stream(main)  # fork: the shared expert
                with torch.npu.stream(side):
                    shared = hidden @ self.w_shared[layer]
                routed = hidden @ self.w_routed[layer]
                if join:
                    main.wait_stream(side)
                x = (shared + routed).view(B, N, 1, D)
            self.final = x

    def step(self, lens: list[int]) -> torch.Tensor:
        u = self.update
        u.wait_event(self.done)  # the previous replay no longer reads the task groups
        with torch.npu.stream(u):
            for layer, handle in enumerate(self.handles):
                o, lse = self.outs[layer]
                torch.npu.graph_task_update_begin(u, handle)
                self.attention(layer, self.queries[layer], lens, workspace=self.ws, out=[o, lse])
                torch.npu.graph_task_update_end(u)
                self.events[layer].record(u)
        with torch.npu.stream(self.main):
            self.graph.replay()
            self.done.record(self.main)
        torch.npu.current_stream().wait_event(self.done)
        return self.final.cpu()


def test_moe_shared_expert_graph_with_attention_updates_matches_eager() -> None:
    model = MoEDecode()
    model.capture()
    # the side stream stays in the capture once joined: one branch, forked and joined
    # back in every layer
    assert len(model.graph.branches) == 1
    for lens in ([S_MAX], [5], [17], [S_MAX - 1]):
        got = model.step(lens)
        want = model.eager(lens)
        assert torch.equal(got, want), lens
    torch.npu.synchronize()
    assert fault() is None


def test_moe_shared_expert_without_its_join_fails_at_capture_end() -> None:
    model = MoEDecode()
    with pytest.raises(SimUsageError, match="not joined"):
        model.capture(join=False)
