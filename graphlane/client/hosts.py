"""The daemons one client talks to: an endpoint resolved to hosts, and each host's state.

:func:`expand` turns a tcp endpoint whose name resolves to several addresses into
one endpoint per address (one daemon per host). A :class:`Host` holds one
daemon's control channel, its workers' channels, its latest ``hello``, and the
worker generations the client adopted for its devices.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

from .args import BatchParams, ProgramOutputs
from .transport import Channel


class Host:
    """One daemon: its control channel and its workers' channels."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.daemon: Channel | None = None
        self.workers: dict[int, Channel] = {}
        self.hello: dict[str, Any] = {}
        # Taken to make or remake a worker's channel (one hello for many callers). FIFO:
        # calls that wait for a device's channel go out in the order they were made.
        self.lock = asyncio.Lock()
        # device -> calls to it waiting for its channel (made or remade): while any
        # waits, a later call waits behind them instead of overtaking them.
        self.connecting: dict[int, int] = {}
        self.batch_params = BatchParams()
        self.outputs = ProgramOutputs()  # what a step that names no outputs gets
        # The worker generation each device's requests name: taken from the hello that
        # first reached the device, changed only by Client.reset_state (a restart must
        # never be adopted silently: the device state it lost would be taken as kept).
        self.generations: dict[int, int] = {}
        # (device, program) -> whether it keeps device state, as self._stateful_of says
        self._stateful: dict[tuple[int, str], bool] = {}
        self._stateful_of: dict[str, Any] | None = None

    def generation_for(self, device: int, program: str | None) -> int | None:
        """What a request to ``program`` (None: a KV op) names: the adopted generation
        when the program keeps device state, else nothing."""
        if program is not None:
            if self._stateful_of is not self.hello:  # a new hello: look again
                self._stateful, self._stateful_of = {}, self.hello
            stateful = self._stateful.get((device, program))
            if stateful is None:
                entry: dict[str, Any] = next(
                    (w for w in self.hello.get("workers", ()) if w.get("device") == device), {}
                )
                described = (entry.get("programs") or {}).get(program)
                stateful = isinstance(described, dict) and bool(described.get("state_ops"))
                self._stateful[(device, program)] = stateful
            if not stateful:
                return None
        return self.generations.get(device)


async def expand(endpoint: str) -> list[str]:
    """A tcp endpoint whose name resolves to several addresses: one endpoint each."""
    if not endpoint.startswith("tcp://"):
        return [endpoint]
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
        return [endpoint]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return [endpoint]  # let the socket report the problem
    addresses = sorted({str(info[4][0]) for info in infos})
    # A name for one machine (localhost: 127.0.0.1 and ::1) is one host, not several.
    if len(addresses) <= 1 or any(ipaddress.ip_address(a).is_loopback for a in addresses):
        return [endpoint]
    return [f"tcp://[{a}]:{port}" if ":" in a else f"tcp://{a}:{port}" for a in addresses]
