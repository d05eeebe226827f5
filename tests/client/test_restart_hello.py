"""A hello the client takes while a worker restarts describes no programs; the client's
channel may then reconnect to the new worker by itself (the same endpoint) without
another hello. Its next step must not be refused in the client as UNKNOWN_PROGRAM
(tests/daemon/test_paged_state.py met it once in a full run)."""

from __future__ import annotations

from typing import Any

import pytest

from graphlane import Client
from graphlane.client.hosts import Host
from graphlane.protocol.errors import UnknownProgram

NOWHERE = "ipc:///tmp/graphlane-test-nobody-listens-here"

PROGRAMS = {"p": {"batch_param": "lengths", "parameters": ["lengths"], "outputs": ["out"]}}


def _hello(state: str, programs: dict[str, Any]) -> dict[str, Any]:
    endpoint = "ipc:///tmp/graphlane-test-worker" if state == "ready" else None
    return {"workers": [{"device": 0, "state": state, "endpoint": endpoint,
                         "programs": programs}]}  # fmt: skip


async def test_a_hello_taken_while_a_worker_restarts_keeps_its_programs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = Client(NOWHERE, timeout=2.0)
    replies = iter([_hello("ready", PROGRAMS), _hello("starting", {}),
                    _hello("ready", {"q": PROGRAMS["p"]})])  # fmt: skip

    async def hello_reply(ch: Any, op: str, body: Any, _timeout: Any) -> dict[str, Any]:
        assert op == "hello"
        return next(replies)

    monkeypatch.setattr(c, "_call", hello_reply)
    monkeypatch.setattr(c, "_channel", lambda host: None)
    host = Host(NOWHERE)  # (as connect makes it; never connected here)
    try:
        await c._hello_on(host)
        seen = await c._hello_on(host)
        assert seen["workers"][0]["state"] == "starting"  # the caller sees the reply as it is
        assert seen["workers"][0]["programs"] == {}
        # ... and the client still describes the programs by the worker it last saw ready
        assert host.batch_params.infer(host.hello, 0, "p", {"lengths": [1, 2, 3]}) == 3
        assert host.outputs.of(host.hello, 0, "p") == ["out"]
        with pytest.raises(UnknownProgram):  # a program it never served is still refused
            host.batch_params.infer(host.hello, 0, "nope", {})
        await c._hello_on(host)  # ready again, serving another program set: that one
        assert host.outputs.of(host.hello, 0, "q") == ["out"]
        with pytest.raises(UnknownProgram):
            host.batch_params.infer(host.hello, 0, "p", {"lengths": [1]})
    finally:
        await c.close()
