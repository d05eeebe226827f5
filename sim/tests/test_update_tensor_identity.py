"""A task update may pass other tensors than its capture, as CANN defines an update.

``aclmdlRICaptureTaskUpdateBegin/End`` re-issue an op into a captured task group: CANN
asks that the re-issued ops give the same number and kind of tasks (the same op, its
tensors in the captured shapes and dtypes, hence the same tiling); the patched task's
tensor addresses are replaced like its other parameters. vllm-ascend's EAGLE proposer
builds a fresh padded block table for each draft step and passes it to the update of
the draft graph's attention (``update_attn_params`` / the ``spec_decode`` graph
update). torch_npu's own ``NPUGraph.update`` keeps the tensors it was given in the
dispatch record (``record.kwargs[key] = update_input[key]``) until the next update;
the raw ``graph_task_update_begin`` API keeps nothing, so a tensor freed while the graph
still uses it is reported at the replay, as a freed captured tensor is.
"""

from __future__ import annotations

import math

import pytest
import torch
from npusim import HazardError, SimUsageError, torch_npu
from npusim.task_groups import abandon_update

FIA = torch_npu.npu_fused_infer_attention_score
B, N, NKV, D, BS, NB, MAXB = 3, 4, 2, 16, 16, 24, 3
SCALE = 1 / math.sqrt(D)


def _reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor,
               lens: list[int]) -> torch.Tensor:  # fmt: skip
    """[B, N*D] float64: each sequence's positions gathered through its table row."""
    out = torch.zeros(B, N * D, dtype=torch.float64)
    for b in range(B):
        slots = [int(table[b, p // BS]) * BS + p % BS for p in range(lens[b])]
        k = kc.reshape(NB * BS, NKV, D)[slots].double()
        v = vc.reshape(NB * BS, NKV, D)[slots].double()
        for h in range(N):
            s = (k[:, h // (N // NKV)] @ q[b, 0, h * D : (h + 1) * D].double()) * SCALE
            out[b, h * D : (h + 1) * D] = torch.softmax(s, dim=0) @ v[:, h // (N // NKV)]
    return out


class DraftGraph:
    """An EAGLE-style draft decode graph: paged attention in a task group behind an
    ExternalEvent, captured with one block table."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(B, 1, N * D, generator=g).half()
        self.kc = torch.randn(NB, BS, NKV * D, generator=g).half()
        self.vc = torch.randn(NB, BS, NKV * D, generator=g).half()
        self.args = (self.q.npu(), self.kc.npu(), self.vc.npu())
        self.kw = dict(block_size=BS, num_heads=N, num_key_value_heads=NKV, scale=SCALE,
                       input_layout="BSH")  # fmt: skip
        captured_table = torch.arange(B * MAXB, dtype=torch.int32).reshape(B, MAXB).npu()
        full = [MAXB * BS] * B
        self.workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
            *self.args, block_table=captured_table, actual_seq_lengths_kv=full, **self.kw
        )
        self.out = torch.empty(B, 1, N * D, dtype=torch.float16, device="npu")
        self.lse = torch.empty(1, dtype=torch.float32, device="npu")
        self.ev, self.update = torch.npu.ExternalEvent(), torch.npu.Stream()
        self.graph = torch.npu.NPUGraph()
        with torch.npu.graph(self.graph):
            s = torch.npu.current_stream()
            self.ev.wait(s)
            self.ev.reset(s)
            torch.npu.graph_task_group_begin(s)
            FIA.out(*self.args, block_table=captured_table, actual_seq_lengths_kv=full,
                    **self.kw, workspace=self.workspace, out=[self.out, self.lse])  # fmt: skip
            self.handle = torch.npu.graph_task_group_end(s)
        # the capture's block table goes away (a temporary of the dummy run): the updates
        # name their own from now on, so no replay may count it as used

    def patch(self, table: torch.Tensor, lens: list[int], fused: bool = False) -> None:
        if fused:
            torch_npu._C._npu_fused_infer_attention_score_out_graph(
                self.update, self.handle, self.ev, *self.args, block_table=table,
                actual_seq_lengths_kv=lens, **self.kw, workspace=self.workspace,
                out=[self.out, self.lse],
            )  # fmt: skip
            return
        with torch.npu.stream(self.update):
            torch.npu.graph_task_update_begin(self.update, self.handle)
            FIA.out(*self.args, block_table=table, actual_seq_lengths_kv=lens, **self.kw,
                    workspace=self.workspace, out=[self.out, self.lse])  # fmt: skip
            torch.npu.graph_task_update_end(self.update)
            self.ev.record(self.update)

    def expected(self, table: torch.Tensor, lens: list[int]) -> torch.Tensor:
        return _reference(self.q, self.kc, self.vc, table, lens)


def _fresh_table(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded block table as the proposer builds it each step: (host copy, npu)."""
    host = torch.randperm(NB, generator=g)[: B * MAXB].reshape(B, MAXB).int()
    return host, host.npu()


@pytest.mark.parametrize("fused", [False, True], ids=["explicit", "fused_binding"])
def test_eagle_fresh_block_table_each_update_gives_its_numbers(fused: bool) -> None:
    draft = DraftGraph()
    g = torch.Generator().manual_seed(7)
    for step, lens in enumerate(([1, 17, 48], [33, 2, 16], [48, 48, 5], [9, 30, 41])):
        host, table = _fresh_table(g)  # a new tensor each step, the captured layout
        if step % 2:
            draft.graph.replay()  # replay then patch (the graph waits at the event)
            draft.patch(table, lens, fused)
        else:
            draft.patch(table, lens, fused)
            draft.graph.replay()
        got = draft.out.cpu().reshape(B, N * D).double()
        torch.testing.assert_close(got, draft.expected(host, lens), atol=3e-3, rtol=3e-3)
        del table  # kept by nobody: this step's replay was issued, the next update replaces it


def test_fresh_table_freed_and_reused_before_the_replay_is_reported() -> None:
    draft = DraftGraph()
    _, table = _fresh_table(torch.Generator().manual_seed(8))
    draft.patch(table, [16, 16, 16])
    draft.graph.replay()
    torch.npu.synchronize()
    ptr = table.data_ptr()
    del table  # the graph's task still reads it: nothing keeps it allocated
    other = torch.full((B, MAXB), NB + 5, dtype=torch.int32, device="npu")
    assert other.data_ptr() == ptr  # its memory went to another tensor
    draft.ev.record(draft.update)  # release the graph's wait: an unchanged step
    draft.graph.replay()
    with pytest.raises(HazardError, match="a task update passed") as err:
        torch.npu.synchronize()
    assert err.value.kind == "use-after-free"


def test_accesses_follow_the_fresh_table() -> None:
    """The race tracking sees the patched task read the new tensor: a host-side write
    of it on another stream, unordered with the replay, is a race."""
    draft = DraftGraph()
    _, table = _fresh_table(torch.Generator().manual_seed(9))
    draft.patch(table, [16, 16, 16])
    draft.graph.replay()
    side = torch.npu.Stream()
    with torch.npu.stream(side):
        table.fill_(0)  # not ordered after the replay that reads it
    with pytest.raises(HazardError, match=r"race on npu memory.*block_table"):
        torch.npu.synchronize()


def test_update_of_another_shape_or_op_is_refused() -> None:
    draft = DraftGraph()
    wider = torch.zeros(B, MAXB + 1, dtype=torch.int32, device="npu")
    with pytest.raises(SimUsageError, match=r"shape/stride/dtype .*another tiling"):
        draft.patch(wider, [16, 16, 16], fused=True)  # (the binding ends the update)
    longs = torch.zeros(B, MAXB, dtype=torch.int64, device="npu")
    with pytest.raises(SimUsageError, match=r"block_table: must be a 2-D int32 tensor"):
        draft.patch(longs, [16, 16, 16], fused=True)
    functional = r"op npu_fused_infer_attention_score.default instead"  # another op
    table = torch.zeros(B, MAXB, dtype=torch.int32, device="npu")
    with pytest.raises(SimUsageError, match=functional), torch.npu.stream(draft.update):
        torch.npu.graph_task_update_begin(draft.update, draft.handle)
        try:
            FIA(*draft.args, block_table=table, actual_seq_lengths_kv=[1] * B,
                **draft.kw)  # fmt: skip
        finally:
            abandon_update(draft.update)
    torch.npu.synchronize()


def test_npugraph_update_holds_the_fresh_table_as_torch_npu_does() -> None:
    """``NPUGraph.update`` stores the values it was given in the dispatch record
    (torch_npu's ``update_capture_record``): a fresh table the caller drops stays
    allocated until the next update replaces it, and its numbers are used."""
    draft = DraftGraph()
    g = torch.npu.NPUGraph()
    captured = torch.zeros(B, MAXB, dtype=torch.int32, device="npu")
    with torch.npu.graph(g, auto_dispatch_capture=True):
        out, _ = FIA(*draft.args, block_table=captured, actual_seq_lengths_kv=[BS] * B,
                     **draft.kw)  # fmt: skip
    gen = torch.Generator().manual_seed(10)
    for lens in ([5, 48, 20], [48, 1, 33]):
        host, table = _fresh_table(gen)
        g.update(cpu_update_input=[{"block_table": table, "actual_seq_lengths_kv": lens}])
        del table  # the record keeps it
        junk = torch.full((B, MAXB), NB + 9, dtype=torch.int32, device="npu")  # no reuse
        g.replay()
        got = out.cpu().reshape(B, N * D).double()
        torch.testing.assert_close(got, draft.expected(host, lens), atol=3e-3, rtol=3e-3)
        del junk
