"""The daemon in serial mode (``pipeline = false``: update, replay, wait for the
replay before the next step, the benchmark baseline) at every slot-ring depth a
user can choose, over several steps on one graph, with numerics checked.

On the simulated NPU the host thread that observes a replay's completion and the
thread that issues the next step's patches are different threads: the sim must
order them as the hardware does (a host's observation of a completion precedes
every later host action), or the second step fails with a HazardError."""

from __future__ import annotations

import asyncio

import pytest
import torch
from daemons import SMALL, RunningDaemon

import graphlane

L, N, NKV, D, MAXKV = (
    SMALL["layers"],
    SMALL["num_heads"],
    SMALL["num_kv_heads"],
    SMALL["head_dim"],
    SMALL["max_kv_len"],
)
STEPS = 6


def expected(lengths: list[int], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    from reference import decode_stack

    return decode_stack(inputs["query"], list(inputs["key"]), list(inputs["value"]), lengths)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_serial_mode_runs_steps_at_every_depth(start_daemon, depth: int) -> None:
    d: RunningDaemon = start_daemon(devices=1, depth=depth, pipeline=False)

    async def main() -> None:
        gen = torch.Generator().manual_seed(100 + depth)
        async with graphlane.Client(d.endpoint, timeout=60) as c:
            for step in range(STEPS):
                batch = 1 + step % 2  # buckets 1 and 2: each graph is patched again
                lengths = torch.randint(1, MAXKV + 1, (batch,), generator=gen).tolist()
                inputs = {
                    "query": torch.randn(batch, N, 1, D, dtype=torch.float16, generator=gen),
                    "key": torch.randn(L, batch, NKV, MAXKV, D, dtype=torch.float16, generator=gen),
                    "value": torch.randn(
                        L, batch, NKV, MAXKV, D, dtype=torch.float16, generator=gen
                    ),
                }
                r = await c.step("attention", 0, {"actual_seq_lengths_kv": lengths}, inputs)
                torch.testing.assert_close(
                    r.outputs["out"], expected(lengths, inputs), atol=2e-3, rtol=2e-3
                )

    asyncio.run(main())
    st = d.status()
    assert st["ready"] and all(w["restarts"] == 0 for w in st["workers"]), st
