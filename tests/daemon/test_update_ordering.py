"""Requests that write the same static buffers are ordered, never raced (issue 40, 1).

An ``update`` patches (and writes the inputs of) the instance the next step of its
bucket runs on. A step sent behind it while other steps were in flight copied its
inputs on the copy stream, unordered with the update's copies on the update stream:
the sim reported the race, the worker restarted, and another client's KV cache was
gone. A program with device state took ``update`` too, though it refuses ``replay``.
The sim's ordering checks are on (compute mode): any unordered access fails the worker.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from daemons import SMALL, RunningDaemon
from paged_kv import Scheduler

from graphlane import GraphlaneError
from graphlane.client import Client
from graphlane.workers.programs import PagedAttentionConfig

L, N, NKV, D, MAXKV = (SMALL[k] for k in ("layers", "num_heads", "num_kv_heads", "head_dim",
                                           "max_kv_len"))  # fmt: skip
PAGED = {"name": "paged_attention", "layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 16, "block_size": 128, "num_blocks": 8, "max_blocks_per_seq": 2,
         "buckets": [1, 2, 4]}  # fmt: skip
CFG = PagedAttentionConfig(
    **{k: v for k, v in PAGED.items() if k != "name"} | {"buckets": (1, 2, 4)}
)  # type: ignore[arg-type]


def _step(gen: torch.Generator, batch: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    lengths = torch.randint(1, MAXKV + 1, (batch,), generator=gen).tolist()
    inputs = {
        "query": torch.randn(batch, N, 1, D, dtype=torch.float16, generator=gen),
        "key": torch.randn(L, batch, NKV, MAXKV, D, dtype=torch.float16, generator=gen),
        "value": torch.randn(L, batch, NKV, MAXKV, D, dtype=torch.float16, generator=gen),
    }
    return {"actual_seq_lengths_kv": lengths}, inputs


def _health(d: RunningDaemon) -> tuple[Any, ...]:
    w = d.worker(0)
    return w["pid"], w["generation"], w["restarts"], w["state"]


def test_updates_between_steps_in_flight_are_ordered_and_another_clients_kv_survives(
    start_daemon: Any,
) -> None:
    d = start_daemon(devices=1, depth=2, programs=[SMALL, PAGED])
    before = _health(d)

    async def main() -> None:
        from reference import decode_stack

        gen = torch.Generator().manual_seed(40)
        async with Client(d.endpoint, timeout=60) as a, Client(d.endpoint, timeout=60) as b:
            # Client b's device state: a prompt's KV in the paged cache.
            slots = list(range(40))
            key = torch.randn(2, len(slots), 2, 16, generator=gen).half()
            value = torch.randn(2, len(slots), 2, 16, generator=gen).half()
            await b.kv_write("paged_attention", 0, slots, key, value)
            # Client a: steps of one bucket kept in flight, updates of it in between,
            # each with inputs of its own (written into the same static buffers).
            for _ in range(3):
                calls, cases = [], []
                for i in range(12):
                    params, inputs = _step(gen, 2)
                    if i % 2:
                        calls.append(a.update("attention", 0, *_step(gen, 2)))
                        cases.append(None)
                    calls.append(a.step("attention", 0, params, inputs))
                    cases.append((params, inputs))
                for r, case in zip(await asyncio.gather(*calls), cases, strict=True):
                    if case is None:
                        assert r.outputs == {}
                        continue
                    params, inputs = case
                    kv = list(inputs["key"]), list(inputs["value"])
                    want = decode_stack(inputs["query"], *kv, params["actual_seq_lengths_kv"])
                    torch.testing.assert_close(r.outputs["out"], want, atol=2e-3, rtol=2e-3)
            back = await b.kv_read("paged_attention", 0, slots)
            assert torch.equal(back.outputs["key"], key)
            assert torch.equal(back.outputs["value"], value)
            assert back.generation == before[1]

    asyncio.run(main())
    assert _health(d) == before
    assert "race" not in d.log().lower()


def test_update_is_refused_for_a_program_with_device_state(start_daemon: Any) -> None:
    """As replay is: an update staged on a paged program's instance would be replayed
    over (or overwritten by) whatever step comes next, maybe another client's."""
    d = start_daemon(devices=1, programs=[PAGED])

    async def main() -> None:
        async with Client(d.endpoint, timeout=60) as c:
            sched = Scheduler(CFG, torch.Generator().manual_seed(1))
            slots, key, value = sched.prefill(0, 5)
            await c.kv_write("paged_attention", 0, slots, key, value)
            inputs, lengths = sched.decode([0])
            try:
                await c.update("paged_attention", 0, {"actual_seq_lengths_kv": lengths}, inputs)
            except GraphlaneError as exc:
                assert exc.code == "BAD_REQUEST" and "update is refused" in str(exc), exc
            else:
                raise AssertionError("update of a program with device state was accepted")

    asyncio.run(main())
