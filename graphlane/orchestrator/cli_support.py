"""Helpers of the ``graphlane`` command line that do more than parse flags."""

from __future__ import annotations

import asyncio
import time

from graphlane.protocol.errors import Timeout, WorkerLost

from .client import Client


async def connect_within(client: Client, wait_s: float, attempt_s: float) -> float:
    """Connect ``client``, retrying until ``wait_s`` has passed (a daemon that is not
    up yet does not answer hello); each attempt has at most ``attempt_s``. Returns
    the seconds left; TIMEOUT naming the endpoint at the deadline."""
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        try:
            await asyncio.wait_for(client.connect(), max(0.05, min(attempt_s, left)))
            return max(0.0, deadline - time.monotonic())
        except (Timeout, TimeoutError, WorkerLost) as exc:
            if time.monotonic() >= deadline:
                raise Timeout(
                    f"no daemon answered at {', '.join(client.requested)} within {wait_s:g} s"
                ) from exc
        await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
