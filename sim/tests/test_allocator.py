"""The simulated NPU's caching allocator: address reuse, per-stream caching, graph
pools, record_stream, the hazards of freeing memory still in use, statistics, OOM."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from npusim import HazardError, SimConfig, configure

npu = torch.npu


@pytest.fixture(autouse=True)
def empty_cache() -> None:
    """Each test starts with no cached free block: what earlier tests freed (sizes round
    to 512 bytes, so theirs may be this test's size) would be handed out first."""
    npu.synchronize()
    gc.collect()
    npu.empty_cache()


@pytest.fixture
def side() -> npu.Stream:
    return npu.Stream()


@pytest.fixture
def small_device() -> Iterator[None]:
    old = configure().device_memory
    yield
    configure(device_memory=old)


# Each test allocates a size no other test uses: a freed block goes to the next
# allocation of its size only when no lower free block of that size is cached.


def test_a_freed_tensor_is_reallocated_at_its_address_with_its_bytes() -> None:
    x = torch.full((3001,), 7.0, device="npu")
    ptr = x.data_ptr()
    del x
    y = torch.empty(3001, device="npu")
    assert y.data_ptr() == ptr
    assert torch.equal(y.cpu(), torch.full((3001,), 7.0))  # the old tensor's bytes


def test_a_view_keeps_the_memory_allocated() -> None:
    x = torch.zeros(3003, device="npu")
    v = x[:16]
    ptr = x.data_ptr()
    del x
    assert torch.empty(3003, device="npu").data_ptr() != ptr
    del v
    assert torch.empty(3003, device="npu").data_ptr() == ptr


def test_freed_blocks_are_cached_per_stream(side: npu.Stream) -> None:
    with npu.stream(side):
        x = torch.zeros(3005, device="npu")
    ptr = x.data_ptr()
    del x
    assert torch.empty(3005, device="npu").data_ptr() != ptr  # another stream
    with npu.stream(side):
        assert torch.empty(3005, device="npu").data_ptr() == ptr


def test_op_outputs_come_from_the_allocator() -> None:
    x = torch.ones(3007, device="npu")
    y = x + 1
    ptr = y.data_ptr()
    del y
    z = x * 3
    assert z.data_ptr() == ptr
    assert torch.equal(z.cpu(), torch.full((3007,), 3.0))


def test_untyped_storage_is_the_allocation() -> None:
    x = torch.zeros(3, 5, device="npu")
    st = x[1:].untyped_storage()
    assert st.data_ptr() == x.data_ptr()
    assert st.nbytes() == 60


def test_statistics_follow_allocations_and_frees() -> None:
    npu.empty_cache()
    base = npu.memory_allocated()
    npu.reset_peak_memory_stats()
    x = torch.empty(1000, dtype=torch.uint8, device="npu")  # rounds to 1024
    assert npu.memory_allocated() == base + 1024
    stats = npu.memory_stats()
    assert stats["allocated_bytes.all.current"] == base + 1024
    assert stats["allocated_bytes.small_pool.current"] >= 1024
    assert stats["requested_bytes.all.current"] >= 1000
    assert stats["segment.all.current"] >= 1
    assert npu.memory_reserved() >= 2 << 20  # small requests share 2 MiB segments
    free, total = npu.mem_get_info()
    assert total == configure().device_memory
    assert free == total - npu.memory_reserved()
    del x
    assert npu.memory_allocated() == base
    assert npu.max_memory_allocated() == base + 1024
    npu.reset_peak_memory_stats()
    assert npu.max_memory_allocated() == base
    nested = npu.memory_stats_as_nested_dict()
    assert nested["allocated_bytes"]["all"]["current"] == base


def test_empty_cache_gives_free_segments_back() -> None:
    npu.empty_cache()
    before = npu.memory_reserved()
    x = torch.empty(4 << 20, dtype=torch.uint8, device="npu")  # a 20 MiB segment
    assert npu.memory_reserved() == before + (20 << 20)
    del x
    assert npu.memory_reserved() == before + (20 << 20)  # cached
    npu.empty_cache()
    assert npu.memory_reserved() == before


def test_out_of_memory_is_the_npus_error(small_device: None) -> None:
    npu.empty_cache()
    configure(device_memory=npu.memory_reserved() + (30 << 20))
    ooms = npu.memory_stats()["num_ooms"]
    kept = torch.empty(12 << 20, dtype=torch.uint8, device="npu")  # its own 12 MiB segment
    with pytest.raises(torch.OutOfMemoryError, match=r"NPU out of memory\. Tried to allocate 20"):
        torch.empty(20 << 20, dtype=torch.uint8, device="npu")
    assert npu.memory_stats()["num_ooms"] == ooms + 1
    del kept  # freed and cached: the next request releases it and retries
    torch.empty(20 << 20, dtype=torch.uint8, device="npu")


def test_device_memory_is_configured_like_the_other_sim_settings(
    small_device: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert configure(device_memory=1 << 30).device_memory == 1 << 30
    assert npu.mem_get_info()[1] == 1 << 30
    with pytest.raises(ValueError, match="device_memory"):
        configure(device_memory=0)
    monkeypatch.setenv("NPUSIM_DEVICE_MEMORY", str(8 << 30))
    assert SimConfig.from_env().device_memory == 8 << 30
    monkeypatch.setenv("NPUSIM_DEVICE_MEMORY", "lots")
    with pytest.raises(ValueError, match="NPUSIM_DEVICE_MEMORY"):
        SimConfig.from_env()


# ---------------------------------------------------------------- cross-stream frees
def _used_on(side: npu.Stream, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.ones(n, device="npu")
    side.wait_stream(npu.current_stream())
    with npu.stream(side):
        y = x * 2  # x used on a stream it was not allocated on
    return x, y


def test_freeing_a_tensor_another_stream_still_uses_is_reported(side: npu.Stream) -> None:
    x, _ = _used_on(side, 3011)
    ptr = x.data_ptr()
    del x
    z = torch.empty(3011, device="npu")
    assert z.data_ptr() == ptr  # reused at once on the allocation stream, as on the NPU
    z.fill_(0)
    # The allocator's report (naming record_stream) or, when side's read of the old
    # tensor runs after the new one's memory was handed out, the access tracker's
    # (the same two accesses, unordered): whichever check sees it first.
    with pytest.raises(HazardError, match=r"record_stream|race on npu memory") as err:
        npu.synchronize()
    assert err.value.kind in ("use-after-free", "race")


def test_record_stream_holds_the_memory_until_that_streams_work_ran(side: npu.Stream) -> None:
    gate = npu.ExternalEvent()
    x = torch.ones(3013, device="npu")
    side.wait_stream(npu.current_stream())
    gate.wait(side)  # side's use of x cannot run before the gate is recorded
    with npu.stream(side):
        y = x * 2
    x.record_stream(side)
    ptr = x.data_ptr()
    del x
    z = torch.empty(3013, device="npu")
    assert z.data_ptr() != ptr  # side's work has not run
    z.fill_(0)
    gate.record(npu.current_stream())
    npu.synchronize()
    assert torch.equal(y.cpu(), torch.full((3013,), 2.0))
    assert torch.empty(3013, device="npu").data_ptr() == ptr  # released once it ran


def test_a_fence_before_the_free_is_enough(side: npu.Stream) -> None:
    x, _y = _used_on(side, 3015)
    npu.current_stream().wait_stream(side)
    ptr = x.data_ptr()
    del x
    z = torch.empty(3015, device="npu")
    assert z.data_ptr() == ptr
    z.fill_(0)
    npu.synchronize()
    x, _y = _used_on(side, 3017)
    side.synchronize()  # the host saw side's use end
    ptr = x.data_ptr()
    del x
    z = torch.empty(3017, device="npu")
    assert z.data_ptr() == ptr
    z.fill_(0)
    npu.synchronize()


# ---------------------------------------------------------------- graph pools
def test_capture_temporaries_are_reused_within_the_capture_not_outside(side: npu.Stream) -> None:
    x = torch.ones(3017, device="npu")
    g = npu.NPUGraph()
    with npu.graph(g, stream=side):
        t = x * 2
        tmp = t.data_ptr()
        del t
        u = x * 3
    assert u.data_ptr() == tmp  # the freed temporary, reused by the capture
    with npu.stream(side):  # eager work on the capture stream: not from the graph's pool
        assert torch.empty(3017, device="npu").data_ptr() != tmp
    g.replay()
    assert torch.equal(u.cpu(), torch.full((3017,), 3.0))


def test_graphs_sharing_a_pool_alias_and_out_of_order_replays_overwrite(side: npu.Stream) -> None:
    x = torch.ones(3019, device="npu")
    y = torch.full((3019,), 10.0, device="npu")
    pool = npu.graph_pool_handle()
    assert pool != npu.graph_pool_handle()
    g1, g2 = npu.NPUGraph(), npu.NPUGraph()
    with npu.graph(g1, pool=pool, stream=side):
        tmp = x + 1
        out1 = tmp * 2
        tmp_ptr = tmp.data_ptr()
        del tmp
    with npu.graph(g2, pool=g1.pool(), stream=side):
        out2 = y + 5
    assert g1.pool() == g2.pool() == pool
    assert out2.data_ptr() == tmp_ptr  # g2's output sits in g1's freed temporary
    g1.replay()
    g2.replay()
    assert torch.equal(out2.cpu(), torch.full((3019,), 15.0))  # capture order: right
    g2.replay()
    g1.replay()  # writes its temporary over g2's output, as on the NPU
    assert torch.equal(out2.cpu(), torch.full((3019,), 2.0))
    assert torch.equal(out1.cpu(), torch.full((3019,), 4.0))


def test_replay_reading_a_freed_and_reallocated_input_is_reported(side: npu.Stream) -> None:
    inp = torch.ones(3021, device="npu")
    g = npu.NPUGraph()
    with npu.graph(g, stream=side):
        out = inp * 2
    g.replay()
    npu.synchronize()
    ptr = inp.data_ptr()
    del inp  # the graph does not keep it alive: its capture did not allocate it
    g.replay()  # freed but not reused yet: stale bytes, nothing to report
    npu.synchronize()
    other = torch.zeros(3021, device="npu")
    assert other.data_ptr() == ptr
    g.replay()
    with pytest.raises(HazardError, match=r"freed after the capture") as err:
        npu.synchronize()
    assert err.value.kind == "use-after-free"
    del out


def test_a_graph_keeps_its_pool_until_reset(side: npu.Stream) -> None:
    x = torch.ones(3023, device="npu")
    npu.empty_cache()
    before = npu.memory_reserved()
    g = npu.NPUGraph()
    with npu.graph(g, stream=side):
        out = x * 2
    del out  # freed into the graph's pool: replays still write there
    npu.empty_cache()
    assert npu.memory_reserved() == before + (2 << 20)
    g.replay()
    npu.synchronize()  # no use-after-free: the pool keeps the memory
    g.reset()
    npu.empty_cache()
    assert npu.memory_reserved() == before


def test_a_replayed_graph_dropped_by_the_program_gives_its_pool_back(side: npu.Stream) -> None:
    # vllm-ascend's ACLGraphWrapper drops the graphs of a discarded capture set (del +
    # gc); the finished replay's bookkeeping must not keep them alive.
    x = torch.ones(3029, device="npu")
    npu.empty_cache()
    before = npu.memory_reserved()
    g = npu.NPUGraph()
    with npu.graph(g, stream=side):
        out = (x * 2) + 1
    g.replay()
    torch.testing.assert_close(out.cpu(), torch.full((3029,), 3.0))
    alive = weakref.ref(g)
    del g, out
    gc.collect()
    npu.synchronize()
    npu.empty_cache()
    assert alive() is None
    assert npu.memory_reserved() == before
