"""Calls of one client to one device go out in the order they were made, also while the
client is still connecting to the device's worker (docs/api.md, "Order of calls"): a
step made after a prefill never reaches the worker before it.

The interleaving is forced, not hoped for: the first call to the device holds the
host's connection lock during its hello; the test then waits for that lock itself, as
a first call to another device does, so that a prefill made next waits behind it while
the device's connection already exists; a step made after that prefill, decoding ahead
from the token the prefill samples, must still go out after it (the worker refuses it
with NO_PREVIOUS_TOKEN otherwise)."""

from __future__ import annotations

import asyncio
import tomllib
from typing import Any

import pytest
import torch

from graphlane.client import Client
from graphlane.demo_model import PROGRAM_TOML

PROGRAMS = tomllib.loads(PROGRAM_TOML)["programs"]


@pytest.fixture
def daemon(shared_daemon: Any) -> Any:
    return shared_daemon(devices=1, programs=PROGRAMS)


async def test_a_step_made_after_a_prefill_never_overtakes_it_while_connecting(
    daemon: Any,
) -> None:
    d = daemon
    async with Client(d.endpoint, timeout=60) as c:
        host = c._hosts[0]
        first = asyncio.create_task(
            c.prefill("model", 0, [1, 2, 3], [0, 0], params={"sequence_id": 901})
        )
        await asyncio.sleep(0)
        assert host.lock.locked() and 0 not in host.workers  # connecting: hello sent
        other_device = asyncio.create_task(host.lock.acquire())  # next in line
        await asyncio.sleep(0)
        prefill = asyncio.create_task(
            c.prefill("model", 0, [5, 6, 7, 8], [1, 0], params={"sequence_id": 902})
        )
        await asyncio.sleep(0)  # it waits for the connection, behind the other device
        await other_device  # the first call connected and sent: the channel exists
        try:
            assert 0 in host.workers
            params = {"actual_seq_lengths_kv": [5], "sequence_id": [902]}
            inputs = {
                "tokens": torch.tensor([-1]),  # the token the prefill above samples
                "block_table": torch.tensor([[1, 0]], dtype=torch.int32),
            }
            step = asyncio.create_task(c.step("model", 0, params, inputs, outputs=["tokens"]))
            await asyncio.sleep(0)
        finally:
            host.lock.release()
        await first
        sampled = (await prefill).outputs["tokens"]
        reply = await step  # refused (NO_PREVIOUS_TOKEN) if it had overtaken the prefill
        assert reply.outputs["tokens"].shape == (1,) and sampled.shape == (1,)
