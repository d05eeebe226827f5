"""The blocking client: the async :class:`~.client.Client`, driven from a private
event-loop thread.

Each method is one line that runs the Client coroutine of the same name, with the
same parameters, on that thread and waits for it: the client is written once, in
async, and this only drives it (a test checks that the two lists of methods and
their signatures agree).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import torch

from .client import Client, Device, StepReply

T = TypeVar("T")


class SyncClient:
    """The async :class:`Client`, driven from a private event-loop thread.

    Every public coroutine of Client is a blocking method here, with the same
    parameters; the constructor connects (Client.connect) and :meth:`close` closes.
    """

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="graphlane-sync-client", daemon=True
        )
        self._thread.start()
        self._client = Client(endpoint, **kwargs)
        try:
            self._run(self._client.connect())
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ operations (see Client)
    def hello(self, timeout: float | None = None) -> dict[str, Any]:
        return self._run(self._client.hello(timeout))

    def status(self, timeout: float | None = None) -> dict[str, Any]:
        return self._run(self._client.status(timeout))

    def drain(self, device: Device | None = None, timeout: float | None = None) -> dict[str, Any]:
        return self._run(self._client.drain(device, timeout))

    def shutdown(self, timeout: float | None = None) -> dict[str, Any]:
        return self._run(self._client.shutdown(timeout))

    def worker_status(self, device: Device, timeout: float | None = None) -> dict[str, Any]:
        return self._run(self._client.worker_status(device, timeout))

    def step(
        self,
        program: str,
        device: Device,
        params: Mapping[str, Any],
        inputs: Mapping[str, torch.Tensor] | None = None,
        outputs: Sequence[str] = ("out",),
        *,
        batch: int | None = None,
        timeout: float | None = None,
    ) -> StepReply:
        """Patch and replay ``program`` on ``device``; returns the requested outputs."""
        return self._run(
            self._client.step(
                program, device, params, inputs, outputs, batch=batch, timeout=timeout
            )
        )

    def update(
        self,
        program: str,
        device: Device,
        params: Mapping[str, Any],
        inputs: Mapping[str, torch.Tensor] | None = None,
        *,
        batch: int | None = None,
        timeout: float | None = None,
    ) -> StepReply:
        """Patch the next replay of the bucket (no replay)."""
        return self._run(
            self._client.update(program, device, params, inputs, batch=batch, timeout=timeout)
        )

    def replay(
        self,
        program: str,
        device: Device,
        batch: int,
        outputs: Sequence[str] = ("out",),
        *,
        timeout: float | None = None,
    ) -> StepReply:
        """Replay the bucket's updated (or next) graph instance."""
        return self._run(self._client.replay(program, device, batch, outputs, timeout=timeout))

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until every worker is ready (polling status); TIMEOUT at the deadline."""
        return self._run(self._client.wait_ready(timeout))
