"""Control operations: ``hello``, ``status``, ``drain``, ``shutdown``.

The daemon answers all four; a worker answers ``hello`` and ``status`` about
itself. Their reply bodies are maps described in the package docstring (they
grow fields over time, so a client reads them as maps).
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from graphlane.protocol.bounds import Count


class Hello(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Handshake: what the server offers (versions, capabilities, workers, programs)."""

    client: Annotated[str, Meta(max_length=128)] = ""


class Status(Struct, frozen=True, forbid_unknown_fields=True):
    """State of the daemon and its workers (or of one worker)."""


class Drain(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Finish in-flight work and accept no more: one device, or all."""

    device: Count | None = None


class Shutdown(Struct, frozen=True, forbid_unknown_fields=True):
    """Drain, stop the workers, exit."""


Info = dict[str, Any]
"""The reply body of hello, status, drain and shutdown: a map."""
