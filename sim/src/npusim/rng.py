"""The NPU's random numbers: torch_npu 2.14's philox generator, graph-safe.

Every rule here is torch_npu 2.14's ``NPUGeneratorImpl.cpp`` and ``NPUGraph.cpp``
(Ascend/pytorch master 9e73e708a, whose strings the 2.14 wheel's ``libtorch_npu.so``
carries), which follow torch's ``CUDAGeneratorImpl.cpp`` ("Lazy Registration of
Generators to the CUDA Graph"):

- A device's generator is a ``(seed, offset)`` pair. A random op takes the pair when
  the host issues it and moves the offset on by its increment (op_plugin passes 10 to
  ``philox_npu_state``; ``increase`` rounds it up to a multiple of 4): its numbers are a
  function of the pair, whenever the stream runs it. The sim draws them from a CPU
  generator seeded from the pair (:func:`draw`): not the NPU's bits, the NPU's rule.
- Issued while the current stream captures, the op instead reads the seed and a base
  offset from two one-element int64 device tensors of *this capture* (allocated on the
  default stream, in its ordinary pool, when the capture's first random op is issued:
  ``NPUGeneratorCaptureState::initialize``), plus its offset inside the graph, which
  starts at 0 and moves on per op. The generator registers itself with the capturing
  graph then; ``capture_end`` keeps the whole capture's increment.
- Each replay first fills the two tensors with the generator's seed and offset on the
  replay stream (``replay_prologue``, two device tasks before the graph's), then moves
  the offset on by the capture's increment: replays draw new numbers, exactly those
  eager calls at those offsets would draw. A graph without a random op registers no
  generator and allocates nothing. ``reset`` (and the graph's destructor) drop the
  capture's state and its two tensors.
- ``manual_seed`` during a capture must keep the seed; ``get_rng_state`` during a
  capture gives the offset inside the graph, ``set_rng_state`` sets it; ``seed``,
  ``get_offset`` and ``set_offset`` refuse to run during a capture.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch

from . import access
from .allocation import allocate, record_stream
from .errors import SimUsageError
from .opcall import OpCall
from .runtime import RUNTIME
from .streams import current_stream, default_stream

#: What op_plugin asks of the generator for one random op (``philox_npu_state(10)``).
INCREMENT = 10
_MASK = (1 << 64) - 1
_capture_ids = itertools.count(1)


def _round4(n: int) -> int:
    return (n + 3) // 4 * 4


def _not_capturing(stream: Any, attempt: str) -> None:
    """torch_npu's ``assertNotCapturing``."""
    if stream.capturing is not None:
        raise SimUsageError(
            f"{attempt} during NPU graph capture. If you need this call to be captured, "
            f"please file an issue. ({stream.name} captures {stream.capturing.graph.name})"
        )


# =================================================================== generator state
class Holder:
    """A one-element int64 device buffer (``at::empty({1}, kLong)``): its CPU view and
    the allocation it keeps (the two attributes of an npu tensor ``record_stream`` reads)."""

    __slots__ = ("_alloc", "_data")

    def __init__(self, index: int, stream: Any) -> None:
        self._data, self._alloc = allocate((1,), (1,), torch.int64, index, stream)
        access.fresh(self._data)


class CaptureRng:
    """``NPUGeneratorCaptureState``: one capture's seed and base offset (device
    memory) and the offset inside the graph."""

    __slots__ = ("holders", "intragraph")

    def __init__(self, holders: tuple[Holder, Holder]) -> None:
        self.holders = holders
        self.intragraph = 0

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.holders[0]._data, self.holders[1]._data


class GeneratorState:
    """``NPUGeneratorState``: seed, offset, and the states of the captures using it."""

    def __init__(self, index: int, seed: int = 67280421310721, offset: int = 0) -> None:
        self.index = index
        self.seed = seed  # c10::default_rng_seed_val
        self.offset = offset
        self.captures: dict[int, CaptureRng] = {}
        self.lock = threading.Lock()

    def clone(self) -> GeneratorState:
        return GeneratorState(self.index, self.seed, self.offset)

    def capture_state(self, stream: Any) -> CaptureRng:
        """The state of the capture ``stream`` takes part in, made (and this generator
        registered with the graph) at its first use (``get_capture_state(id, true)``)."""
        graph_rng: GraphRng = stream.capturing.graph.rng
        cid = graph_rng.capture_id
        state = self.captures.get(cid)
        if state is not None:
            return state
        # on the default stream: its ordinary pool, not the graph's (initialize())
        default = default_stream(self.index)
        holders = (Holder(self.index, default), Holder(self.index, default))
        with self.lock:
            state = self.captures.setdefault(cid, CaptureRng(holders))
        graph_rng.states.setdefault(self, 0)
        return state

    def take(self, stream: Any) -> Philox:
        """``philox_npu_state(INCREMENT)`` for an op issued on ``stream``."""
        step = _round4(INCREMENT)
        if stream.capturing is not None:
            cap = self.capture_state(stream)
            with self.lock:
                at = cap.intragraph
                cap.intragraph += step
            return Philox(0, at, cap.views())
        with self.lock:
            at = self.offset
            self.offset += step
            return Philox(self.seed, at, None)

    def replay_prologue(self, capture_id: int, increment: int, stream: Any) -> None:
        """Fill the capture's seed and offset on ``stream`` (before the replay), then
        move the offset on by the capture's increment. Caller holds RUNTIME.cond."""
        if not increment:
            return
        with self.lock:
            cap = self.captures.get(capture_id)
            seed, offset = self.seed, self.offset
            self.offset += increment
        if cap is None:  # pragma: no cover - torch_npu's internal assert
            raise SimUsageError("replay_prologue called but no capture state found")
        seed_t, offset_t = cap.views()

        def fill() -> None:
            seed_t.fill_(seed if seed < 1 << 63 else seed - (1 << 64))  # int64 bits
            offset_t.fill_(offset)

        items = (access.item(seed_t, True, "RNG seed"), access.item(offset_t, True, "RNG offset"))
        footprint = tuple(it for it in items if it is not None)
        work = access.AccessWork("fill of the RNG seed and offset", fill, lambda: footprint)
        stream.issue_locked(work)
        for holder in cap.holders:
            record_stream(holder, stream)


class Philox:
    """What a random op reads when it runs: its seed and offset, given at issue, or
    read then from its capture's device tensors (plus its offset in the graph)."""

    __slots__ = ("at", "holders", "seed")

    def __init__(self, seed: int, at: int, holders: tuple[torch.Tensor, torch.Tensor] | None):
        self.seed, self.at, self.holders = seed, at, holders

    def values(self) -> tuple[int, int]:
        holders = self.holders
        if holders is None:
            return self.seed, self.at
        return int(holders[0][0]) & _MASK, int(holders[1][0]) + self.at

    def footprint(self) -> access.Footprint:
        if self.holders is None:
            return ()
        seed, offset = self.holders
        items = (access.item(seed, False, "RNG seed"), access.item(offset, False, "RNG offset"))
        return tuple(it for it in items if it is not None)


# =================================================================== the graph's side
class GraphRng:
    """``NPUGraph::captured_generator_states_``: the generators its capture used and
    each one's whole-graph increment. Holds no reference to its graph (the graph's
    finalizer calls :meth:`release`)."""

    def __init__(self) -> None:
        self.capture_id = 0
        self.states: dict[GeneratorState, int] = {}

    def begin(self) -> None:
        self.release()
        self.capture_id = next(_capture_ids)

    def end(self) -> None:
        for state in self.states:
            cap = state.captures.get(self.capture_id)
            self.states[state] = cap.intragraph if cap is not None else 0
            if cap is not None:
                cap.intragraph = 0  # NPUGeneratorCaptureState::finalize

    def replay_prologue_locked(self, stream: Any) -> None:
        for state, increment in self.states.items():
            state.replay_prologue(self.capture_id, increment, stream)

    def release(self) -> None:
        """``NPUGraph::reset``: the captures' states (and their tensors) go."""
        for state in self.states:
            with state.lock:
                state.captures.pop(self.capture_id, None)
        self.states.clear()


# =================================================================== the generator object
class NpuGenerator(torch.Generator):
    """``torch.npu.default_generators[i]``: the device's generator (a torch.Generator for
    ``isinstance``; a CPU generator underneath that nothing uses)."""

    state: GeneratorState

    def __new__(cls, index: int = 0, state: GeneratorState | None = None) -> NpuGenerator:
        self = super().__new__(cls)
        self.state = state if state is not None else GeneratorState(index)
        return self

    @property  # (torch.Generator's is a read-only C attribute; its stub says writeable)
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("npu", self.state.index)

    def _stream(self) -> Any:
        return current_stream(self.state.index)

    def manual_seed(self, seed: int) -> NpuGenerator:
        """``set_current_seed``: resets the offset; during a capture only the same seed."""
        seed = int(seed) & _MASK
        state, stream = self.state, self._stream()
        if stream.capturing is not None:
            if seed != state.seed:
                raise SimUsageError(
                    "NPUGeneratorImpl::set_current_seed can be called during stream capture "
                    "only if new seed is the same as the original seed."
                )
            return self
        with state.lock:
            state.seed, state.offset = seed, 0
        return self

    def seed(self) -> int:
        _not_capturing(self._stream(), "Cannot call NPUGeneratorImpl::seed while in capture mode")
        value = int(torch.Generator().seed()) & _MASK  # a nondeterministic value
        self.manual_seed(value)
        return value

    def initial_seed(self) -> int:
        return self.state.seed

    def get_offset(self) -> int:
        _not_capturing(
            self._stream(), "Cannot call NPUGeneratorImpl::get_offset while in capture mode"
        )
        return self.state.offset

    def set_offset(self, offset: int) -> NpuGenerator:
        _not_capturing(
            self._stream(), "Cannot call NPUGeneratorImpl::set_offset while in capture mode"
        )
        self._set_offset(int(offset))
        return self

    def _set_offset(self, offset: int) -> None:
        """``set_philox_offset_per_thread``: the offset inside the graph while capturing."""
        if offset % 4:
            raise SimUsageError("offset must be a multiple of 4")
        stream = self._stream()
        if stream.capturing is not None:
            self.state.capture_state(stream).intragraph = offset
        else:
            self.state.offset = offset

    def _offset(self) -> int:
        stream = self._stream()
        if stream.capturing is not None:
            return self.state.capture_state(stream).intragraph
        return self.state.offset

    def get_state(self) -> torch.Tensor:
        """16 bytes: the seed (uint64) and the offset (int64), as ``get_state``."""
        seed = self.state.seed
        words = torch.tensor([seed if seed < 1 << 63 else seed - (1 << 64), self._offset()])
        return words.view(torch.uint8).clone()

    def set_state(self, new_state: torch.Tensor) -> NpuGenerator:
        if new_state.dtype != torch.uint8 or new_state.device.type != "cpu":
            raise SimUsageError("RNG state must be a torch.ByteTensor")
        if new_state.numel() not in (8, 16):
            raise SimUsageError("RNG state is wrong size")
        words = new_state.contiguous().view(torch.int64).tolist()
        self.manual_seed(words[0] & _MASK)
        self._set_offset(words[1] if len(words) > 1 else 0)
        return self

    def graphsafe_get_state(self) -> NpuGenerator:
        """A generator sharing this one's state (``graphsafe_get_state``)."""
        return NpuGenerator(self.state.index, self.state)

    def graphsafe_set_state(self, state: torch.Generator) -> NpuGenerator:
        if not isinstance(state, NpuGenerator):
            raise SimUsageError("Expected a NPU Generator")
        self.state = state.state
        return self

    def clone_state(self) -> NpuGenerator:
        _not_capturing(
            self._stream(), "Cannot call NPUGeneratorImpl::clone_impl while in capture mode"
        )
        return NpuGenerator(self.state.index, self.state.clone())


# =================================================================== random ops
class SeededCall(OpCall):
    """A random op: its numbers come from the generator pair it took at issue."""

    __slots__ = ("philox",)

    def __init__(self, call: OpCall, philox: Philox) -> None:
        super().__init__(call.op, call.args, call.kwargs, call.outs, call.host)
        self.philox = philox

    def execute(self) -> Any:
        seed, offset = self.philox.values()
        return self.deliver(draw(self.op, self.args, self.kwargs, seed, offset))


def _mix(seed: int, offset: int) -> int:
    """A 64-bit CPU seed from the pair (splitmix64 of both)."""
    z = (seed * 0x9E3779B97F4A7C15 + offset + 0x632BE59BD9B4E019) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


_RUNNERS: dict[Any, Callable[..., Any]] = {}


def draw(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int, offset: int) -> Any:
    """Run ``op`` on the CPU with a generator seeded from ``(seed, offset)``."""
    runner = _RUNNERS.get(op)
    if runner is None:
        runner = _RUNNERS[op] = _runner(op)
    gen = torch.Generator()
    gen.manual_seed(_mix(seed, offset))
    return runner(args, kwargs, gen)


def _runner(op: Any) -> Callable[..., Any]:
    if op is torch.ops.aten.native_dropout.default:
        return _native_dropout
    names = [a.name for a in op._schema.arguments]
    if "generator" in names:
        at = names.index("generator")

        def with_generator(args: tuple[Any, ...], kwargs: dict[str, Any], gen: Any) -> Any:
            if len(args) > at:
                if args[at] is None:
                    args = (*args[:at], gen, *args[at + 1 :])
            elif kwargs.get("generator") is None:
                kwargs = {**kwargs, "generator": gen}
            return op(*args, **kwargs)

        return with_generator
    # rand, randn, randint, randperm, rand_like, ...: the overload that takes a generator
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[1])
    for name in packet.overloads():
        other = getattr(packet, name)
        others = [a.name for a in other._schema.arguments]
        if "generator" in others and [n for n in others if n != "generator"] == names:
            return lambda args, kwargs, gen: other(*args, **kwargs, generator=gen)
    return lambda args, kwargs, gen: op(*args, **kwargs)  # CPU generator: not seeded


def _native_dropout(args: tuple[Any, ...], kwargs: dict[str, Any], gen: Any) -> Any:
    x, p = args[0], float(args[1])
    train = args[2] if len(args) > 2 else kwargs.get("train")
    if train is False:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    mask = torch.empty_like(x).bernoulli_(1 - p, generator=gen).to(torch.bool)
    scale = 0.0 if p >= 1 else 1.0 / (1 - p)
    return x * mask * scale, mask


#: ``torch.npu.default_generators``: one per device.
DEFAULT_GENERATORS: tuple[NpuGenerator, ...] = tuple(
    NpuGenerator(i) for i in range(RUNTIME.device_count)
)


def default_generator(index: int) -> NpuGenerator:
    return DEFAULT_GENERATORS[index]
