"""Roles with CurveZMQ (docs/security.md): only the keys the config names in
``admin_keys`` may drain or shut down, on the daemon's socket and on a worker's; a
program whose config names its ``clients`` serves only them, its device state included.
Any other admitted key is refused FORBIDDEN, and the daemon serves on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from daemons import SMALL, RunningDaemon
from paged_kv import Scheduler
from test_paged_state import CFG, PAGED

from graphlane import GraphlaneError
from graphlane.client import Client
from graphlane.protocol import ops, security

ATTENTION = {"actual_seq_lengths_kv": [3]}


def _keys(tmp_path: Path) -> Path:
    """DIR/server.key_secret; admitted clients ops, sched-a and sched-b."""
    keys = tmp_path / "keys"
    security.generate(keys, "server")
    for name in ("ops", "sched-a", "sched-b"):
        security.generate(keys / "clients", name)
    return keys


def _as(keys: Path, name: str) -> dict[str, str]:
    return {
        "server_key": str(keys / "server.key"),
        "client_key": str(keys / "clients" / f"{name}.key_secret"),
    }


async def _code(call: Any) -> str:
    """The code ``call`` fails with; FORBIDDEN is never retryable."""
    with pytest.raises(GraphlaneError) as info:
        await call
    assert info.value.retryable == (info.value.code == "SHUTTING_DOWN")
    return str(info.value.code)


def test_only_an_admin_key_drains_or_shuts_the_daemon_down(start_daemon: Any, tmp_path) -> None:
    keys = _keys(tmp_path)
    d: RunningDaemon = start_daemon(
        devices=1, programs=[SMALL], auth_dir=str(keys), admin_keys=["ops"],
        client_keys=_as(keys, "ops"),
    )  # fmt: skip

    async def main() -> None:
        async with Client(d.endpoint, timeout=20, **_as(keys, "sched-b")) as c:
            assert await _code(c.shutdown()) == "FORBIDDEN"
            assert await _code(c.drain()) == "FORBIDDEN"
            assert await _code(c.drain(0)) == "FORBIDDEN"
            # Nothing was drained: the daemon and its worker serve this key on.
            assert (await c.status())["state"] == "running"
            assert (await c.step("attention", 0, ATTENTION)).outputs["out"].shape[0] == 1
        assert d.proc.poll() is None
        async with Client(d.endpoint, timeout=20, **_as(keys, "ops")) as c:
            await c.shutdown()
        assert await asyncio.to_thread(d.proc.wait, 60) == 0

    asyncio.run(main())
    d.stopped = True


def test_a_program_serves_only_its_clients_and_a_worker_drains_for_an_admin_only(
    start_daemon: Any, tmp_path
) -> None:
    keys = _keys(tmp_path)
    d: RunningDaemon = start_daemon(
        devices=1, auth_dir=str(keys), admin_keys=["ops"], client_keys=_as(keys, "ops"),
        programs=[PAGED | {"clients": ["sched-a"]}, SMALL],
    )  # fmt: skip
    sched = Scheduler(CFG, torch.Generator().manual_seed(3))
    slots, key, value = sched.prefill(0, 5)
    inputs, lengths = sched.decode([0])
    paged = "paged_attention"

    async def main() -> None:
        async with (
            Client(d.endpoint, timeout=20, **_as(keys, "sched-a")) as a,
            Client(d.endpoint, timeout=20, **_as(keys, "sched-b")) as b,
        ):
            await a.kv_write(paged, 0, slots, key, value)
            # sched-b may not touch paged_attention, nor its cache.
            assert await _code(b.kv_write(paged, 0, slots, key * 0, value * 0)) == "FORBIDDEN"
            assert await _code(b.kv_read(paged, 0, slots)) == "FORBIDDEN"
            params = {"actual_seq_lengths_kv": lengths}
            assert await _code(b.step(paged, 0, params, inputs)) == "FORBIDDEN"
            assert await _code(b.replay(paged, 0, 1)) == "FORBIDDEN"
            # sched-a is served, and its cache is as it wrote it.
            read = await a.kv_read(paged, 0, slots)
            assert torch.equal(read.outputs["key"], key)
            r = await a.step(paged, 0, params, inputs)
            torch.testing.assert_close(
                r.outputs["out"], sched.expected([0], inputs["query"]), atol=3e-3, rtol=3e-3
            )
            # A program without clients serves every admitted key.
            assert (await b.step("attention", 0, ATTENTION)).outputs["out"].shape[0] == 1

            # The worker's own socket: drain (and shutdown) need an admin key too.
            ch = await b._worker(0)
            assert await _code(ch.call(9001, ops.OPS["drain"], ops.Drain(0), 10)) == "FORBIDDEN"
            assert await _code(ch.call(9002, ops.OPS["shutdown"], ops.Shutdown(), 10)) == (
                "FORBIDDEN"
            )
            assert (await b.worker_status(0))["state"] == "ready"
            await a.step(paged, 0, params, inputs)
            async with Client(d.endpoint, timeout=20, **_as(keys, "ops")) as admin:
                ch = await admin._worker(0)
                drained = await ch.call(9003, ops.OPS["drain"], ops.Drain(0), 10)
                assert drained["state"] == "draining"
            assert await _code(a.step(paged, 0, params, inputs)) == "SHUTTING_DOWN"

    asyncio.run(main())


MODEL = {"name": "model", "block_size": 128, "num_blocks": 4, "max_blocks_per_seq": 1,
         "buckets": [1], "prefill_chunk": 16, "dtype": "float32",
         "random": {"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                    "intermediate_size": 64, "num_hidden_layers": 1,
                    "num_attention_heads": 2, "num_key_value_heads": 1}}  # fmt: skip


def test_a_sequence_is_its_client_keys_across_connections_and_no_other_keys(
    start_daemon: Any, tmp_path
) -> None:
    """With CURVE a sequence belongs to the key that added it (docs/models.md, "Whose
    sequence"): another connection of that key decodes ahead from it; another key naming
    the same id is refused NO_PREVIOUS_TOKEN and leaves it as it was."""
    keys = _keys(tmp_path)
    d: RunningDaemon = start_daemon(
        devices=1, auth_dir=str(keys), programs=[MODEL], client_keys=_as(keys, "ops")
    )
    ahead = {"actual_seq_lengths_kv": [4], "sequence_id": [7]}
    inputs = {"tokens": torch.tensor([-1]), "block_table": torch.tensor([[0]], dtype=torch.int32)}

    async def main() -> None:
        async with Client(d.endpoint, timeout=30, **_as(keys, "sched-a")) as a:
            await a.prefill("model", 0, [1, 2, 3], [0], params={"sequence_id": 7})
        async with Client(d.endpoint, timeout=30, **_as(keys, "sched-b")) as b:
            assert await _code(b.step("model", 0, ahead, inputs)) == "NO_PREVIOUS_TOKEN"
        async with Client(d.endpoint, timeout=30, **_as(keys, "sched-a")) as a2:
            r = await a2.step("model", 0, ahead, inputs, outputs=["tokens"])
            assert r.outputs["tokens"].shape == (1,)

    asyncio.run(main())
