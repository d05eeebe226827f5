"""A decode step's bytes and the worker's host CPU for it, the generic ``step`` (the
scheduler sends every row's token, length, sequence id and whole block table: the API
before the sequence operations) against the typed ``decode`` (the worker keeps them),
at 4 and 64 blocks per sequence, in one run (docs/performance.md, "Sequence operations").

Bytes: the request's frames as the client's codec encodes them. Worker CPU: the host
work a worker does for one decode before any device work, timed in this process on a
tiny random model: decode the request's frames, validate and plan the step (the
engine's issue, the same for both, is left out).

.venv/bin/python benchmarks/sequences.py [--rows 8] [--reps 2000]
"""

from __future__ import annotations

import argparse
import time

import torch

from graphlane.protocol import ops
from graphlane.protocol.wire import Codec
from graphlane.workers.programs.model import ModelConfig, ModelProgram

ARCH = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
BLOCK = 128


def _size(frames: list) -> int:
    return sum(memoryview(f).nbytes for f in frames)


def measure(width: int, rows: int, reps: int) -> dict[str, float]:
    program = ModelProgram(ModelConfig(random=ARCH, block_size=BLOCK, num_blocks=rows * width,
                                       max_blocks_per_seq=width, buckets=(rows,)))  # fmt: skip
    codec = Codec()
    context = width * BLOCK - 1  # the longest sequences this width serves
    tables = torch.arange(rows * width, dtype=torch.int32).reshape(rows, width)
    owner = b"client"
    for sid in range(rows):  # the worker's record of each sequence (add), host side only
        program.plan_sequences("add", {"sequence": sid, "tokens": torch.arange(context - 1) % 256,
                                       "blocks": tables[sid].tolist()}, owner)  # fmt: skip
    step = ops.Step("model", 0, {"actual_seq_lengths_kv": [context] * rows,
                                 "sequence_id": list(range(rows))},
                    {"tokens": torch.full((rows,), -1),
                     "block_table": tables}, outputs=["tokens"], generation=1)  # fmt: skip
    decode = ops.Decode("model", 0, list(range(rows)), outputs=["tokens"], generation=1)
    out: dict[str, float] = {}
    for name, op, body in (("step", "step", step), ("decode", "decode", decode)):
        frames = codec.encode_request(1, op, body)
        out[f"{name}_bytes"] = _size(frames)
        t0 = time.process_time()
        for _ in range(reps):
            (req,) = codec.decode_requests(frames)
            b = req.body
            if name == "step":
                program.plan(rows, b.params, b.inputs)
            else:
                for seq in program._sequences[owner].values():
                    seq.length = context - 1  # each rep plans the same token
                fields = {"sequences": b.sequences, "new_blocks": b.new_blocks}
                program.plan_sequences("decode", fields, owner)
        out[f"{name}_cpu_us"] = (time.process_time() - t0) / reps * 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="sequences per decode step")
    p.add_argument("--reps", type=int, default=2000, help="timed repetitions")
    args = p.parse_args()
    print(f"{args.rows} rows | blocks/seq | step B | decode B | step CPU us | decode CPU us")
    for width in (4, 64):
        r = measure(width, args.rows, args.reps)
        print(f"{width:>10} | {r['step_bytes']:>6.0f} | {r['decode_bytes']:>8.0f} | "
              f"{r['step_cpu_us']:>11.1f} | {r['decode_cpu_us']:>13.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
