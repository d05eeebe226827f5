"""A client that goes away releases its sequences (docs/models.md, "Whose sequence"):
real daemons, real worker processes, real sockets. Without a key the connection is the
client: its sequences (and the blocks they hold) go when it closes, another client's
stay. With CURVE a key's go ``sequence_grace_s`` after its last connection closed; a
connection of the same key back within the grace keeps them."""

from __future__ import annotations

import asyncio
from typing import Any

from daemons import RunningDaemon
from test_roles import MODEL, _as, _keys

from graphlane.client import Client

PROMPT = [1, 2, 3]


async def _held(endpoint: str, keys: dict[str, str] | None = None) -> dict[str, Any]:
    """The worker's record of its clients' sequences (on a connection of its own)."""
    async with Client(endpoint, timeout=30, **(keys or {})) as c:
        st = await c.worker_status(0)
    return {
        **st["sequences"]["model"],
        "leaving": st["sequence_clients_leaving"],
        "released": st["metrics"]["sequences_released"],
    }


async def _until(endpoint: str, ok: Any, keys: dict[str, str] | None = None) -> dict[str, Any]:
    """Poll the worker's record until ``ok(record)``; a deadline, not a timing claim."""
    for _ in range(600):
        held = await _held(endpoint, keys)
        if ok(held):
            return held
        await asyncio.sleep(0.1)
    raise AssertionError(f"never: {held}")


def test_a_closed_connections_sequences_and_blocks_are_freed_and_no_other_clients(
    start_daemon: Any,
) -> None:
    d: RunningDaemon = start_daemon(devices=1, programs=[MODEL])
    blocks = MODEL["num_blocks"]

    async def main() -> None:
        async with Client(d.endpoint, timeout=30) as b:
            a = Client(d.endpoint, timeout=30)
            await a.connect()
            # both number their sequences from 1; a holds two blocks, b one
            await a.add_sequence("model", 0, 1, PROMPT, [0])
            await a.add_sequence("model", 0, 2, PROMPT, [1])
            await b.add_sequence("model", 0, 1, PROMPT, [2])
            first = (await b.decode("model", 0, [1])).outputs["tokens"].tolist()
            held = await _held(d.endpoint)
            assert (held["clients"], held["sequences"]) == (2, 3)
            assert (held["blocks_free"], held["released"]) == (blocks - 3, 0)
            await a.close()  # a goes: its connection closes
            held = await _until(d.endpoint, lambda h: h["sequences"] == 1)
            assert (held["clients"], held["blocks_free"]) == (1, blocks - 1)
            assert (held["released"], held["leaving"]) == (2, 0)
            # b's sequence goes on where it was, and a's blocks are free to add into
            second = (await b.decode("model", 0, [1])).outputs["tokens"].tolist()
            assert len(first) == len(second) == 1
            await b.add_sequence("model", 0, 2, PROMPT, [0])
            assert (await b.free_sequences("model", 0, [1, 2]))["freed"] == [1, 2]

    asyncio.run(main())


def test_a_keys_sequences_outlive_a_quick_reconnect_and_go_after_the_grace(
    start_daemon: Any, tmp_path: Any
) -> None:
    keys = _keys(tmp_path)
    ops = _as(keys, "ops")
    # One daemon whose grace outlasts any reconnect, one whose grace is nearly none.
    long = start_daemon(devices=1, auth_dir=str(keys), programs=[MODEL], client_keys=ops,
                        sequence_grace_s=600)  # fmt: skip
    short = start_daemon(devices=1, auth_dir=str(keys), programs=[MODEL], client_keys=ops,
                         sequence_grace_s=0.2)  # fmt: skip

    async def main() -> None:
        for d in (long, short):
            async with Client(d.endpoint, timeout=30, **_as(keys, "sched-a")) as a:
                await a.add_sequence("model", 0, 7, PROMPT, [0])
                await a.decode("model", 0, [7])
            async with Client(d.endpoint, timeout=30, **_as(keys, "sched-b")) as b:
                await b.add_sequence("model", 0, 7, PROMPT, [1])
        # long: both keys are leaving, nothing released; sched-a back keeps its 7
        held = await _until(long.endpoint, lambda h: h["leaving"] == 2, ops)
        assert (held["sequences"], held["released"]) == (2, 0)
        async with Client(long.endpoint, timeout=30, **_as(keys, "sched-a")) as a2:
            r = await a2.decode("model", 0, [7])
            assert r.outputs["tokens"].shape == (1,)
            held = await _held(long.endpoint, ops)
            assert (held["sequences"], held["leaving"]) == (2, 1)
        # short: both keys' sequences go, with their blocks
        held = await _until(short.endpoint, lambda h: h["sequences"] == 0, ops)
        assert (held["released"], held["leaving"], held["clients"]) == (2, 0, 0)
        assert held["blocks_free"] == MODEL["num_blocks"]

    asyncio.run(main())


def test_a_groups_followers_release_a_gone_clients_sequences_too(start_daemon: Any) -> None:
    """Only a group's leader sees its clients' connections: it forwards their release,
    so a follower keeps no gone client's sequences. Else, past max_sequences, a follower
    refuses an add the leader took (its record full of the gone ones) and the group
    restarts, every client's sequences lost."""
    caps = {"max_sequences": 3, "max_sequences_per_client": 3, "tensor_parallel": 2}
    d: RunningDaemon = start_daemon(devices=2, programs=[{**MODEL, **caps}])

    async def main() -> None:
        async with Client(d.endpoint, timeout=30) as b:
            for round_ in range(2):  # twice the cap, added by clients that go
                a = Client(d.endpoint, timeout=30)
                await a.connect()
                for sid in range(3):
                    await a.add_sequence("model", 0, sid, PROMPT, [sid])
                await a.close()
                await _until(d.endpoint, lambda h, r=round_: h["released"] == 3 * (r + 1))
            for sid in range(3):
                await b.add_sequence("model", 0, sid, PROMPT, [sid])
            assert len((await b.decode("model", 0, [0])).outputs["tokens"]) == 1
            st = await b.status()
            assert [w["restarts"] for w in st["workers"]] == [0, 0], st["workers"]

    asyncio.run(main())
