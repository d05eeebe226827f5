"""SyncClient is written out method by method: it must keep mirroring Client."""

from __future__ import annotations

import inspect

from graphlane.client import Client, SyncClient

# The constructor of SyncClient connects: it has no connect() of its own.
CONSTRUCTOR = {"connect"}


def public_coroutines(cls: type) -> dict[str, object]:
    return {
        name: member
        for name, member in inspect.getmembers(cls, inspect.iscoroutinefunction)
        if not name.startswith("_")
    }


def test_every_public_coroutine_of_client_has_a_blocking_twin_with_its_signature() -> None:
    coroutines = public_coroutines(Client)
    assert {"step", "update", "replay", "status", "close"} <= set(coroutines)
    missing = []
    for name, coroutine in coroutines.items():
        if name in CONSTRUCTOR:
            continue
        method = getattr(SyncClient, name, None)
        if method is None or inspect.iscoroutinefunction(method):
            missing.append(name)
            continue
        assert inspect.signature(method) == inspect.signature(coroutine), name
    assert not missing, f"SyncClient lacks blocking versions of {missing}"


def test_syncclient_has_no_public_method_that_client_lacks() -> None:
    own = {"close"}  # close() is a coroutine of Client too; listed for clarity
    extra = [
        name
        for name, _ in inspect.getmembers(SyncClient, inspect.isfunction)
        if not name.startswith("_") and name not in own and not hasattr(Client, name)
    ]
    assert not extra, f"SyncClient methods without a Client coroutine: {extra}"
