"""What Ascend/pytorch's own graph tests check, learned from their call shapes
(``test/test_npu.py``, ``test/npu/test_aclgraph_update.py``): the repr of streams and
events as torch_npu 2.14 prints them (``npu/streams.py``), the error of a capture on the
default stream (``NPUGraph::capture_begin``), the warning of an empty capture, the debug
dump in the runtime's JSON with its ``.aligned.json`` (``npu/graphs.py``,
``npu/_npugraph_utils.py``), and three successive captures into one pool.
"""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from npusim import SimUsageError, torch_npu


def test_stream_and_event_repr_as_torch_npu_prints_them() -> None:
    s = torch.npu.Stream()
    assert repr(s) == f"<torch_npu.npu.Stream device=npu:0 npu_stream={s.npu_stream:#x}>"
    e = torch.npu.Event()
    assert repr(e) == "<torch_npu.npu.Event uninitialized>"  # created by its first record
    s.record_event(e)
    assert repr(e) == f"<torch_npu.npu.Event {e.npu_event:#x}>"
    x = torch.npu.ExternalEvent()
    assert repr(x) == "<torch_npu.npu.ExternalEvent uninitialized>"
    x.record(s)
    assert repr(x).startswith("<torch_npu.npu.ExternalEvent 0x")
    torch.npu.synchronize()


def test_capture_on_the_default_stream_is_torch_npus_error() -> None:
    g = torch.npu.NPUGraph()
    with pytest.raises(RuntimeError, match="NPU graphs must be captured on a non-default stream"):
        g.capture_begin()
    assert isinstance(SimUsageError("x"), RuntimeError)
    a = torch.full((100,), 1.0).npu()
    s = torch.npu.Stream()
    with torch.npu.stream(s):  # on a side stream it captures; it replays on the default one
        g.capture_begin()
        b = a + 1
        g.capture_end()
    torch.npu.current_stream().wait_stream(s)
    g.replay()
    torch.testing.assert_close(b.cpu(), torch.full((100,), 1.0) + 1)


def test_an_empty_capture_warns_and_a_capture_with_work_does_not() -> None:
    s = torch.npu.Stream()
    with pytest.warns(UserWarning, match="The NPU Graph is empty"), torch.npu.stream(s):
        g = torch.npu.NPUGraph()
        g.capture_begin()
        g.capture_end()
    x = torch.ones(3).npu()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.npu.graph(torch.npu.NPUGraph()):
            x.mul_(2)


def _fork_join_capture(join: bool) -> tuple[torch_npu.npu.NPUGraph, torch.Tensor, torch.Tensor]:
    x = torch.arange(8.0).npu()
    g, side = torch.npu.NPUGraph(), torch.npu.Stream()
    with torch.npu.graph(g):
        y = x * 2
        side.wait_stream(torch.npu.current_stream())
        with torch.npu.stream(side):
            z = y + 1
        if join:
            torch.npu.current_stream().wait_stream(side)
        w = y * 3
    return g, z, w


def test_debug_dump_is_the_runtimes_json_and_its_aligned_trace(tmp_path: Path) -> None:
    g, z, w = _fork_join_capture(join=True)
    g.replay()
    torch.testing.assert_close(z.cpu(), torch.arange(8.0) * 2 + 1)
    torch.testing.assert_close(w.cpu(), torch.arange(8.0) * 6)
    path = tmp_path / "jsonPrint.json"
    assert g.debug_dump(str(path)) is None
    raw = json.loads(path.read_text())
    assert raw and all(ev["ph"] == "X" and ev["tid"].startswith("stream") for ev in raw)
    assert len({ev["tid"] for ev in raw}) == 2  # the capture stream and the side branch
    aligned = json.loads((tmp_path / "jsonPrint.aligned.json").read_text())
    tasks = [ev for ev in aligned if ev["ph"] == "X"]
    by_name = {ev["name"]: ev for ev in tasks}
    records = [n for n in by_name if n.startswith("EVENT_RECORD_")]
    assert records
    for rec in records:  # every cross-stream wait ends where its record ends
        wait = by_name.get("EVENT_WAIT_" + rec.rsplit("_", 1)[-1])
        if wait is not None and wait["tid"] != by_name[rec]["tid"]:
            end = by_name[rec]["ts"] + by_name[rec]["dur"]
            assert wait["ts"] >= end - 1e-9 or wait["ts"] + wait["dur"] == pytest.approx(end)
    for tid in {ev["tid"] for ev in tasks}:  # each stream from 0, 0.2 between its tasks
        lane = sorted((ev for ev in tasks if ev["tid"] == tid), key=lambda e: e["ts"])
        assert lane[0]["ts"] == 0.0
        for a, b in itertools.pairwise(lane):
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"] + 0.2)
    assert {ev["ph"] for ev in aligned} >= {"s", "f"}  # a flow per record/wait pair


def test_debug_dump_keeps_the_raw_dump_when_alignment_fails_and_writes_nothing_uncaptured(
    tmp_path: Path,
) -> None:
    g, _, _ = _fork_join_capture(join=True)
    path = tmp_path / "jsonPrint.failure.json"
    with mock.patch.object(
        torch.npu._npugraph_utils, "align_trace_json", side_effect=RuntimeError("alignment failed")
    ) as align:
        assert g.debug_dump(str(path)) is None
    align.assert_called_once_with(str(path), None)
    assert path.stat().st_size > 0 and not (tmp_path / "jsonPrint.failure.aligned.json").exists()
    before = path.read_bytes()
    with mock.patch.object(torch.npu._npugraph_utils, "align_trace_json") as align, pytest.warns(
        UserWarning, match="without a preceding successful capture"
    ):
        assert torch.npu.NPUGraph().debug_dump(str(path)) is None
    align.assert_not_called()
    assert path.read_bytes() == before


def test_a_fork_without_its_join_is_refused_before_anything_is_dumped() -> None:
    with pytest.raises(SimUsageError, match=r"join"):
        _fork_join_capture(join=False)


@pytest.mark.parametrize("share", ["none", "pool()", "graph_pool_handle()"])
def test_three_successive_captures_into_one_pool(share: str) -> None:
    size, s = 1000, torch.npu.Stream()
    a = torch.ones(size).npu()
    g0, g1, g2 = (torch.npu.NPUGraph() for _ in range(3))
    s.wait_stream(torch.npu.current_stream())
    with torch.npu.stream(s):
        args0 = (torch.npu.graph_pool_handle(),) if share == "graph_pool_handle()" else ()
        g0.capture_begin(*args0)
        b = a.clone()
        c, d = b + 1, b + 2
        g0.capture_end()
        args = (g0.pool(),) if share == "pool()" else args0
        g1.capture_begin(*args)
        e = c + 3
        del c
        g1.capture_end()
        g2.capture_begin(*args)
        f = d + 4
        g2.capture_end()
    torch.npu.current_stream().wait_stream(s)
    for g in (g0, g1, g2):  # capture order: right in every case
        g.replay()
    assert (e.sum().item(), f.sum().item()) == (size * 5, size * 7)
    for g in (g0, g2, g1):  # out of order: a shared pool gave c's block to f, as on the NPU
        g.replay()
    assert e.sum().item() == (size * 5 if share == "none" else size * (7 + 3))
    assert f.sum().item() == size * 7

