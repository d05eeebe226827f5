"""The blocking client: the async :class:`~.client.Client`, driven from a private
event-loop thread.

Each method is one line that runs the Client coroutine of the same name, with the
same parameters, on that thread and waits for it: the client is written once, in
async, and this only drives it (a test checks that the two lists of methods and
their signatures agree).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import torch

from graphlane.protocol.errors import WorkerLost

from .client import Client, Device, StepReply

log = logging.getLogger("graphlane.client")

T = TypeVar("T")


class SyncClient:
    """The async :class:`Client`, driven from a private event-loop thread.

    Every public coroutine of Client is a blocking method here, with the same
    parameters; the constructor connects (Client.connect) and :meth:`close` closes.
    """

    def __init__(self, endpoint: str | Sequence[str], **kwargs: Any) -> None:
        self._client = Client(endpoint, **kwargs)  # checks its arguments: no thread yet
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="graphlane-sync-client", daemon=True
        )
        self._thread.start()
        # Stops the loop thread and closes the sockets when the SyncClient is closed,
        # collected unclosed, or alive at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_loop, self._loop, self._thread, self._client)
        try:
            self._run(self._client.connect())
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._finalizer.alive:
            coro.close()
            raise WorkerLost("the client was closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a SyncClient cannot be called from its own event-loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Close the connection and stop the loop thread; idempotent, from any thread."""
        self._finalizer()

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
        outputs: str | Sequence[str] | None = None,
        *,
        batch: int | None = None,
        timeout: float | None = None,
    ) -> StepReply:
        """Patch and replay ``program`` on ``device``; returns the requested outputs
        (default: every output of the program; see :meth:`Client.step`)."""
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
        outputs: str | Sequence[str] | None = None,
        *,
        timeout: float | None = None,
    ) -> StepReply:
        """Replay the bucket's updated (or next) graph instance."""
        return self._run(self._client.replay(program, device, batch, outputs, timeout=timeout))

    def kv_write(self, program: str, device: Device, slots: Any, key: Any, value: Any,
                 *, timeout: float | None = None) -> StepReply:  # fmt: skip
        return self._run(self._client.kv_write(program, device, slots, key, value, timeout=timeout))

    def kv_read(
        self, program: str, device: Device, slots: Any, *, timeout: float | None = None
    ) -> StepReply:
        return self._run(self._client.kv_read(program, device, slots, timeout=timeout))

    def prefill(
        self,
        program: str,
        device: Device,
        tokens: Any,
        block_table: Any,
        *,
        start: int = 0,
        params: Mapping[str, Any] | None = None,
        outputs: str | Sequence[str] = ("tokens",),
        timeout: float | None = None,
    ) -> StepReply:
        return self._run(
            self._client.prefill(
                program, device, tokens, block_table, start=start, params=params,
                outputs=outputs, timeout=timeout,
            )
        )  # fmt: skip

    def add_sequence(
        self,
        program: str,
        device: Device,
        sequence: int,
        tokens: Any,
        blocks: Sequence[int],
        *,
        params: Mapping[str, Any] | None = None,
        outputs: str | Sequence[str] = ("tokens",),
        timeout: float | None = None,
    ) -> StepReply:
        return self._run(
            self._client.add_sequence(
                program, device, sequence, tokens, blocks, params=params, outputs=outputs,
                timeout=timeout,
            )
        )  # fmt: skip

    def decode(
        self,
        program: str,
        device: Device,
        sequences: Sequence[int],
        *,
        new_blocks: Mapping[int, Sequence[int]] | None = None,
        outputs: str | Sequence[str] = ("tokens",),
        timeout: float | None = None,
        as_lists: bool = False,
    ) -> StepReply:
        return self._run(
            self._client.decode(program, device, sequences, new_blocks=new_blocks,
                                outputs=outputs, timeout=timeout, as_lists=as_lists)
        )  # fmt: skip

    def append_blocks(
        self, program: str, device: Device, sequence: int, blocks: Sequence[int],
        *, timeout: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        return self._run(
            self._client.append_blocks(program, device, sequence, blocks, timeout=timeout)
        )

    def free_sequences(
        self, program: str, device: Device, sequences: Sequence[int],
        *, timeout: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        return self._run(self._client.free_sequences(program, device, sequences, timeout=timeout))

    def generation(self, device: Device) -> int | None:
        return self._client.generation(device)

    def reset_state(self, device: Device, timeout: float | None = None) -> int:
        return self._run(self._client.reset_state(device, timeout))

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until every worker is ready (polling status); TIMEOUT at the deadline."""
        return self._run(self._client.wait_ready(timeout))


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, client: Client) -> None:
    """Close ``client`` on its loop, stop the loop and join its thread (bounded)."""
    if loop.is_closed():
        return
    own = threading.current_thread() is thread
    if thread.is_alive():
        done = threading.Event()

        def stop() -> None:
            try:
                client._close_now()
            finally:
                loop.stop()
                done.set()

        try:
            loop.call_soon_threadsafe(stop)
        except RuntimeError:  # closed meanwhile
            return
        if own:
            return  # the loop stops after this callback; nobody is left to join it
        done.wait(_STOP_WAIT_S)
        thread.join(_STOP_WAIT_S)
    if not thread.is_alive():
        loop.close()
    else:
        log.warning("the SyncClient's loop thread did not stop; leaving it (daemon thread)")


_STOP_WAIT_S = 5.0
