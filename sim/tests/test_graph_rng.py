"""Random numbers in captured graphs, as torch_npu 2.14's graph-safe philox generator
gives them (issue 33): a replay draws new numbers, those an eager call at the
generator's offset draws, and moves the offset on by what the capture consumed; the
capture's seed and offset live in two one-element device tensors of the default
stream's pool, filled on the replay stream before each replay.

Call shapes from the field: dropout in a captured forward, vllm's random sampler
(``probs.div_(q.exponential_()).argmax``) and sglang's ``torch.multinomial`` sampling
captured with the decode step; torch_npu's own test_aclgraph_rng_state.py (the RNG
state API during a capture); torch's ``graphsafe_get_state``/``graphsafe_set_state``.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from npusim import HazardError, SimUsageError, reset_device, torch_npu

npu = torch_npu.npu
STEP = 12  # op_plugin's increment of 10, rounded up to a multiple of 4


def _offset() -> int:
    return int(npu.get_rng_state().view(torch.int64)[1])


def sampler(probs: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """vllm's random sampling: exponential noise, then the argmax of probs / noise."""
    q.exponential_()
    torch.argmax(probs / q, dim=-1, out=out)


def capture(fn, *args) -> torch.npu.NPUGraph:  # type: ignore[no-untyped-def]
    s = npu.Stream()
    s.wait_stream(npu.current_stream())
    g = npu.NPUGraph()
    with npu.graph(g, stream=s):
        fn(*args)
    npu.current_stream().wait_stream(s)
    return g


def test_captured_sampler_replays_new_draws_equal_to_eager_at_their_offsets() -> None:
    probs = torch.softmax(torch.randn(4, 64), -1).npu()
    q, out = torch.empty(4, 64, device="npu"), torch.empty(4, dtype=torch.int64, device="npu")
    drafts = torch.empty(4, 1, dtype=torch.int64, device="npu")

    def step() -> None:
        sampler(probs, q, out)
        torch.multinomial(probs, 1, out=drafts)  # sglang-style sampling in the same graph

    g = capture(step)
    npu.manual_seed(7)
    seen = []
    for _ in range(3):
        g.replay()
        torch.randn(8)  # the host's own CPU random numbers: not the device's generator
        seen.append((q.cpu(), out.cpu(), drafts.cpu()))
    assert _offset() == 3 * 2 * STEP  # each replay moves it on by what the capture took
    assert not torch.equal(seen[0][0], seen[1][0]) and not torch.equal(seen[1][0], seen[2][0])

    npu.manual_seed(7)  # the same sequence, eager
    for q_g, out_g, drafts_g in seen:
        step()
        assert torch.equal(q.cpu(), q_g) and torch.equal(out.cpu(), out_g)
        assert torch.equal(drafts.cpu(), drafts_g)


def test_dropout_graph_interleaved_with_eager_dropout_matches_an_eager_run() -> None:
    """test_npu.py's graphed -> eager -> graphed sequence, in a forward's dropout."""
    x = torch.randn(256).npu()
    out = torch.empty(256, device="npu")
    g = capture(lambda: out.copy_(F.dropout(F.dropout(x, p=0.3), p=0.3)))
    npu.manual_seed(3)
    g.replay()
    first = out.cpu()
    x_next = torch.randn(256)  # the host makes its next input: CPU numbers, not the device's
    eager_between = F.dropout(x, p=0.3).cpu()
    g.replay()
    second = out.cpu()
    assert not torch.equal(first, second)
    assert _offset() == 5 * STEP and x_next.shape == (256,)
    npu.manual_seed(3)
    assert torch.equal(F.dropout(F.dropout(x, p=0.3), p=0.3).cpu(), first)
    assert torch.equal(F.dropout(x, p=0.3).cpu(), eager_between)
    assert torch.equal(F.dropout(F.dropout(x, p=0.3), p=0.3).cpu(), second)


def test_rng_state_api_during_a_capture() -> None:
    """torch_npu's test_aclgraph_rng_state.py: get/set_rng_state inside the capture give
    and set the offset inside the graph; manual_seed there must keep the seed."""
    npu.manual_seed(123)
    state = npu.get_rng_state()
    eager_first = torch.rand(8, device="npu").cpu()
    npu.set_rng_state(state)
    torch.rand(8, device="npu")
    eager_next = torch.rand(8, device="npu").cpu()

    npu.manual_seed(123)
    g = npu.NPUGraph()
    with npu.graph(g):
        inner = npu.get_rng_state()
        first = torch.rand(8, device="npu")
        npu.set_rng_state(inner)
        second = torch.rand(8, device="npu")
    npu.manual_seed(123)
    g.replay()
    assert torch.equal(first.cpu(), eager_first) and torch.equal(second.cpu(), eager_first)
    assert torch.equal(torch.rand(8, device="npu").cpu(), eager_next)

    g2 = npu.NPUGraph()
    with pytest.raises(SimUsageError, match="only if new seed is the same"), npu.graph(g2):
        npu.manual_seed(124)
    with pytest.raises(SimUsageError, match="seed while in capture mode"), npu.graph(
        npu.NPUGraph()
    ):
        npu.seed()


def test_a_capture_with_random_ops_holds_a_seed_and_an_offset_outside_its_pool() -> None:
    """The two one-element holders (512-byte blocks, the default stream's pool) exist
    once a random op is captured and go with the graph; a capture without one has none."""
    x = torch.ones(16, device="npu")
    gc.collect()
    npu.empty_cache()

    def active() -> int:
        return npu.memory_stats()["active.small_pool.current"]

    before = active()
    plain = capture(lambda: x.add_(1))
    assert active() - before == 0  # its result aliases x: nothing from its pool either
    del plain
    gc.collect()

    before, bytes_before = active(), npu.memory_stats()["active_bytes.small_pool.current"]
    g = capture(lambda: x.bernoulli_(0.5))
    assert active() - before == 2
    assert npu.memory_stats()["active_bytes.small_pool.current"] - bytes_before == 1024
    g.replay()
    npu.synchronize()
    g.reset()
    assert active() == before
    g = capture(lambda: x.bernoulli_(0.5))
    del g
    gc.collect()
    assert active() == before


def test_one_graph_replayed_on_two_streams_without_a_fence_is_reported() -> None:
    """Each replay fills the capture's seed and offset on its stream: a replay on another
    stream overwrites them while the first replay's random op may read them. Fenced, the
    same schedule runs clean."""
    probs = torch.softmax(torch.randn(2, 32), -1).npu()
    q, out = torch.empty(2, 32, device="npu"), torch.empty(2, dtype=torch.int64, device="npu")
    for fenced in (True, False):
        g = capture(sampler, probs, q, out)
        a, b = npu.Stream(), npu.Stream()
        a.wait_stream(npu.current_stream())
        with npu.stream(a):
            g.replay()
        if fenced:
            b.wait_stream(a)
        with npu.stream(b):
            if not fenced:
                with pytest.raises(HazardError) as err:
                    g.replay()
                    npu.synchronize()
                assert err.value.kind == "race"
                assert "RNG" in str(err.value)  # the race is on the generator's holders
                reset_device()
                continue
            g.replay()
        npu.synchronize()


def test_graphsafe_state_swap_captures_on_a_cloned_generator_state() -> None:
    """torch's graphsafe_get_state / clone_state / graphsafe_set_state: a capture while
    the default generator holds a cloned state draws from, and advances, that state."""
    gen = npu.default_generators[0]
    npu.manual_seed(11)
    original = gen.graphsafe_get_state()
    private = gen.clone_state()
    gen.graphsafe_set_state(private)
    x = torch.empty(32, device="npu")
    g = capture(lambda: x.uniform_())
    gen.graphsafe_set_state(original)
    g.replay()
    assert private.get_offset() == STEP and gen.get_offset() == 0
    drawn = x.cpu()
    assert torch.equal(torch.empty(32, device="npu").uniform_().cpu(), drawn)  # seed 11, 0
    with pytest.warns(DeprecationWarning, match="no-op"):
        g.register_generator_state(gen)


def test_ops_that_write_an_argument_return_their_own_result() -> None:
    """rrelu_with_noise writes its noise and returns a new tensor; native_batch_norm
    writes its running statistics and returns new ones: their results are not the
    argument they write."""
    x = torch.randn(64)
    y = F.rrelu(x.npu(), training=True).cpu()
    assert torch.equal(y[x >= 0], x[x >= 0])
    ratio = y[x < 0] / x[x < 0]
    assert ((ratio >= 1 / 8 - 1e-6) & (ratio <= 1 / 3 + 1e-6)).all()

    b = torch.randn(8, 4)
    rm, rv = torch.zeros(4), torch.ones(4)
    ref = F.batch_norm(b, rm.clone(), rv.clone(), training=True)
    rm_n, rv_n = rm.npu(), rv.npu()
    got = F.batch_norm(b.npu(), rm_n, rv_n, training=True).cpu()
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(rm_n.cpu(), b.mean(0) * 0.1)
