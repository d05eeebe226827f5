"""The worker's host work per decode step does not grow with the model's layers where it
need not: a real Worker (its loop's handler, the engine, the model program, the ``null``
backend), fed encoded ``add`` and ``decode`` requests as its socket loop hands them over,
with the program's per-group hooks counted (docs/performance.md, "Third session").

Counts, not times: what a step asks of the program is the same on any machine."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from graphlane.demo_model import ARCHITECTURE
from graphlane.protocol import ops, wire
from graphlane.workers.worker import Worker, WorkerSpec

PEER = b"\x00peer"
ROWS = 2
BLOCK = 128


def _program(layers: int) -> dict[str, Any]:
    return {
        "name": "model", "random": {**ARCHITECTURE, "num_hidden_layers": layers},
        "seed": 1, "init_std": 0.02, "dtype": "float32", "block_size": BLOCK,
        "num_blocks": 2 * ROWS, "max_blocks_per_seq": 2, "buckets": [ROWS],
    }  # fmt: skip


@pytest.fixture
def worker_of(tmp_path: Path) -> Iterator[Any]:
    made: list[tuple[Worker, Any, Any]] = []

    def make(layers: int) -> Worker:
        parent, child = mp.Pipe()
        spec = WorkerSpec(device=0, backend="null", programs=(_program(layers),),
                          endpoint=f"ipc://{tmp_path}/w{len(made)}.sock")  # fmt: skip
        w = Worker(spec, child)
        made.append((w, parent, child))
        return w

    yield make
    for w, parent, child in made:
        w.engine.close()
        w.sock.close(0)
        w.ctx.destroy(0)
        w.loop.close()
        parent.close()
        child.close()


def _decode_steps(w: Worker, steps: int) -> None:
    """Add ROWS sequences, then ``steps`` decodes of them, each answered before the next
    is handed over (the null device finishes a step at once; its patches' thread may be
    the one that ends it, and posts the answer to the loop, run here)."""
    gen = w.spec.generation
    ids = iter(range(1, 10**6))

    def handle(op: str, body: Any) -> None:
        w.loop.handle([PEER, *wire.encode_request(next(ids), op, body)])
        deadline = time.monotonic() + 30
        while w.inflight:
            assert time.monotonic() < deadline, f"{op} was not answered"
            w.loop._take_wakeups()
            time.sleep(0.0005)

    for r in range(ROWS):
        blocks = [2 * r, 2 * r + 1]
        handle("add", ops.AddSequence("model", 0, r, torch.tensor([1 + r] * 4), blocks,
                                      generation=gen))  # fmt: skip
    for _ in range(steps):
        handle("decode", ops.Decode("model", 0, list(range(ROWS)), generation=gen))
    assert w.inflight == 0
    assert w.responder.counters["errors"] == 0


def _per_step_hooks(w: Worker, steps: int) -> Counter[str]:
    """How often ``steps`` decode steps ask the program for each of its per-group hooks,
    and the backend for a patch."""
    program = w.engine.programs["model"]
    counts: Counter[str] = Counter()
    hooks = [(program, n) for n in ("input_writes", "group_signature", "group_call", "group_calls")]
    for owner, name in [*hooks, (w.engine.backend, "patch")]:
        method = getattr(owner, name)

        def counted(*args: Any, _m: Any = method, _n: str = name) -> Any:
            counts[_n] += 1
            return _m(*args)

        setattr(owner, name, counted)  # the instance's: the real method runs
    _decode_steps(w, steps)
    return counts


@pytest.mark.parametrize("layers", [2, 6])
def test_a_decode_asks_for_its_inputs_and_its_signature_once_whatever_its_layers(
    worker_of: Any, layers: int
) -> None:
    """The model program's inputs all land before layer 0 and its layers share the
    step's signature (its lengths): a decode asks for each once, not once per layer, and
    for its layers' calls in one pass; each layer is still patched, one patch each."""
    steps = 5
    counts = _per_step_hooks(worker_of(layers), steps)
    assert counts["input_writes"] == steps
    assert counts["group_signature"] == steps
    assert counts["group_calls"] == steps
    assert counts["group_call"] == 0
    assert counts["patch"] == steps * layers
