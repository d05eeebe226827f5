"""A decode step's bytes and the worker's host CPU for it, at 4 and 64 blocks per sequence
(docs/performance.md, "Sequence operations").

Bytes: the request's frames as the client's codec encodes them, the generic ``step``
(the scheduler sends every row's token, length, sequence id and whole block table: the
API before the sequence operations) against the typed ``decode`` (the worker keeps them).

Worker CPU: the model program's host work for one ``decode`` on the null backend (no
device: its copies and the device ops it issues cost what the null device costs), as the
worker and its engine call it: decode the request's frames, plan the step, its feeds
(and their copies into the instance's buffers), its input copies, every layer's patch
arguments (``group_signature``, ``group_call``; the backend's patch itself is the
engine's and the backend's, left out) and ``issued``; and the host-to-device copies it
issues (count, bytes) per decode. Sequences are re-added every
``--per-round`` decodes (untimed) so that each stays in its blocks.

``--before DIR`` measures the tree whose ``graphlane`` package is in DIR too (a
``git archive`` of another commit), in a subprocess, alternating with this tree's:
before and after in one run.

.venv/bin/python benchmarks/sequences.py [--rows 8] [--layers 20] [--reps 2000] [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from graphlane.protocol import ops
from graphlane.protocol.wire import Codec
from graphlane.workers.backends.null import NullBackend
from graphlane.workers.programs.base import CapturedGraph, GraphKey
from graphlane.workers.programs.model import ModelConfig, ModelProgram

BLOCK = 128


def _size(frames: list) -> int:
    return sum(memoryview(f).nbytes for f in frames)


class _CountingNull(NullBackend):
    """The null device, counting the host-to-device copies issued to it."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0
        self.copied = 0

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies += 1
        self.copied += src.numel() * src.element_size()


def _program(width: int, rows: int, layers: int) -> ModelProgram:
    arch = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2}  # fmt: skip
    return ModelProgram(ModelConfig(random=arch, block_size=BLOCK, num_blocks=rows * width,
                                    max_blocks_per_seq=width, buckets=(rows,),
                                    dtype="float32"))  # fmt: skip


def measure(
    width: int, rows: int, layers: int, reps: int, per_round: int, profile: Any = None
) -> dict[str, float]:
    """The figures of one width; ``profile`` (a cProfile.Profile) runs in the timed part."""
    program = _program(width, rows, layers)
    backend = _CountingNull()
    buffers = program.allocate(backend, rows)
    graph = CapturedGraph(GraphKey(program.name, rows, 0), None, [], [], buffers, [])
    codec = Codec()
    owner = b"client"
    tables = torch.arange(rows * width, dtype=torch.int32).reshape(rows, width)
    start = (width - 1) * BLOCK  # the step's sequences: in their last block
    step = ops.Step("model", 0, {"actual_seq_lengths_kv": [start + 1] * rows,
                                 "sequence_id": list(range(rows))},
                    {"tokens": torch.full((rows,), -1), "block_table": tables},
                    outputs=["tokens"], generation=1)  # fmt: skip
    decode = ops.Decode("model", 0, list(range(rows)), outputs=["tokens"], generation=1)
    out = {"step_bytes": float(_size(codec.encode_request(1, "step", step)))}
    frames = codec.encode_request(1, "decode", decode)
    out["decode_bytes"] = float(_size(frames))
    groups = program.num_groups
    spent = 0.0
    done = 0
    h2d = [0, 0]  # host-to-device copies, bytes
    while done < reps:
        program.sequence_change("free", {"sequences": list(range(rows))}, owner)
        for sid in range(rows):  # each sequence's add, issued as the engine does: a
            # one-token prompt with all its blocks (the table's width is what costs)
            fields = {"sequence": sid, "tokens": torch.tensor([sid]),
                      "blocks": tables[sid].tolist()}  # fmt: skip
            plan = program.plan_sequences("add", fields, owner)
            program.run_state(backend, plan)
            program.issued(plan, None, None, owner)
        n = min(per_round, reps - done, BLOCK - 1)
        if profile is not None:
            profile.enable()
        copies, copied = backend.copies, backend.copied
        t0 = time.process_time()
        for _ in range(n):
            (req,) = codec.decode_requests(frames)
            b = req.body
            plan = program.plan_sequences(
                "decode", {"sequences": b.sequences, "new_blocks": b.new_blocks}, owner
            )
            feeds = program.feeds(plan, owner)
            for group in range(groups):
                for dst, src in program.input_writes(buffers, plan, group):
                    backend.copy_in(dst, src)
            for feed in feeds:
                buffers[feed.buffer][feed.index].copy_(feed.source)
            for group in range(groups):
                program.group_signature(plan, group)
                program.group_call(buffers, plan, group)
            program.issued(plan, graph, None, owner)
        spent += time.process_time() - t0
        h2d[0] += backend.copies - copies
        h2d[1] += backend.copied - copied
        if profile is not None:
            profile.disable()
        done += n
    out["decode_cpu_us"] = spent / reps * 1e6
    out["h2d_copies"], out["h2d_bytes"] = h2d[0] / reps, h2d[1] / reps
    return out


def _run(args: argparse.Namespace, width: int, tree: str | None) -> dict[str, float]:
    if tree is None:
        return measure(width, args.rows, args.layers, args.reps, args.per_round)
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, __file__, "--rows", str(args.rows), "--layers", str(args.layers),
           "--reps", str(args.reps), "--per-round", str(args.per_round),
           "--one", str(width)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="sequences per decode step")
    p.add_argument("--layers", type=int, default=20, help="the model's layers")
    p.add_argument("--reps", type=int, default=2000, help="timed decodes per measurement")
    p.add_argument("--per-round", type=int, default=100, help="decodes between re-adds")
    p.add_argument("--rounds", type=int, default=2, help="alternations with --before")
    p.add_argument("--before", help="a directory holding another tree's graphlane package")
    p.add_argument("--profile", action="store_true", help="this tree's hot spots (cProfile)")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a subprocess's measurement
    args = p.parse_args()
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        measure(4, args.rows, args.layers, args.reps, args.per_round, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return
    if args.one is not None:
        r = measure(args.one, args.rows, args.layers, args.reps, args.per_round)
        print(json.dumps(r))
        return
    trees: list[tuple[str, str | None]] = [("this tree", None)]
    if args.before:
        trees.insert(0, ("before", args.before))
    print(f"{args.rows} rows, {args.layers} layers | tree | blocks/seq | step B | decode B | "
          "H2D copies, bytes per decode | worker CPU per decode, us")  # fmt: skip
    for _ in range(args.rounds if args.before else 1):
        for width in (4, 64):
            for name, tree in trees:
                r = _run(args, width, tree)
                print(f"{name:>10} | {width:>10} | {r['step_bytes']:>6.0f} | "
                      f"{r['decode_bytes']:>8.0f} | {r['h2d_copies']:.0f}, {r['h2d_bytes']:.0f} | "
                      f"{r['decode_cpu_us']:>8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
