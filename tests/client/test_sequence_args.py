"""A careless caller's sequence ids and block numbers are refused at the call, naming the
argument, before anything is sent: never rounded (1.7 is not sequence 1), never parsed
("3" is not sequence 3), never a raw OverflowError from the encoder."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from graphlane import Client
from graphlane.client.args import InvalidArgument, as_ids

# Nothing listens there: a call that got past its argument checks would wait for hello.
NOWHERE = "ipc:///tmp/graphlane-test-nobody-listens-here"


def _calls(c: Client) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
    return [
        ("sequences[0]", lambda: c.decode("model", 0, [1.7])),
        ("sequences[1]", lambda: c.decode("model", 0, [1, "3"])),
        ("sequences[0]", lambda: c.decode("model", 0, [-1])),
        ("sequences[0]", lambda: c.decode("model", 0, [2**63])),
        ("sequences[0]", lambda: c.decode("model", 0, [True])),
        ("sequences", lambda: c.decode("model", 0, 5)),
        ("new_blocks", lambda: c.decode("model", 0, [1], new_blocks={1.5: [2]})),
        ("new_blocks[1][0]", lambda: c.decode("model", 0, [1], new_blocks={1: [-2]})),
        ("new_blocks", lambda: c.decode("model", 0, [1], new_blocks=[1, 2])),
        ("sequence", lambda: c.add_sequence("model", 0, 2.0, [1, 2], [0])),
        ("sequence", lambda: c.add_sequence("model", 0, 2**64, [1, 2], [0])),
        ("blocks[0]", lambda: c.add_sequence("model", 0, 2, [1, 2], [0.0])),
        ("sequence", lambda: c.append_blocks("model", 0, "7", [1])),
        ("blocks[1]", lambda: c.append_blocks("model", 0, 7, [1, -1])),
        ("sequences[0]", lambda: c.free_sequences("model", 0, [None])),
    ]


async def test_a_wrong_sequence_id_or_block_is_refused_at_the_call() -> None:
    c = Client(NOWHERE, timeout=2.0)  # never connected: a checked call sends nothing
    try:
        for name, call in _calls(c):
            with pytest.raises(InvalidArgument) as err:
                await call()
            assert err.value.code == "BAD_REQUEST", name
            assert err.value.message.startswith(name + ":"), (name, err.value.message)
    finally:
        await c.close()


def test_numpy_integers_are_ids() -> None:
    assert as_ids(np.array([3, 4]).tolist(), "x") == [3, 4]
    assert as_ids([np.int64(3), 4], "x") == [3, 4]
    assert as_ids(range(2), "x") == [0, 1]


def test_plain_ids_are_checked_whole_not_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode's ids, plain ints in range (every step of a scheduler), are checked as a
    list, with no per-id call and message (the step's host work, docs/performance.md);
    anything else is still looked at id by id and named (the test above)."""
    from graphlane.client import args

    looked_at: list[Any] = []
    real = args.as_id

    def counted(value: Any, what: str, most: int | None = None) -> int:
        looked_at.append(value)
        return real(value, what, most)

    monkeypatch.setattr(args, "as_id", counted)
    assert as_ids([3, 0, 7, 2**62], "sequences", 2**62) == [3, 0, 7, 2**62]
    assert as_ids((1, 2), "x") == [1, 2] and as_ids([], "x") == []
    assert looked_at == []
    with pytest.raises(InvalidArgument, match=r"^BAD_REQUEST: sequences\[1\]"):
        as_ids([3, 2**62 + 1], "sequences", 2**62)
    with pytest.raises(InvalidArgument, match=r"^BAD_REQUEST: x\[2\]"):
        as_ids([0, 1, True], "x")
    assert as_ids([np.int64(5), 1], "x") == [5, 1]
    assert looked_at  # the mixed lists went id by id
