"""Operations on a program's device state (its paged KV cache): ``kv_write``, ``kv_read``;
and ``resume``, which ends a connection's refusals after a failed state change.

Answered by the device's worker, in order with the replays of the program's graphs
(the worker issues them on the stream its replays run on): a ``kv_write`` sent after a
step's reply, or before a step's request, is seen by that step, and a ``kv_read`` sees
every step and write sent before it. Blocks and slots are the scheduler's to manage:
slot ``s`` is position ``s % block_size`` of block ``s // block_size``; the program's
``hello`` entry gives ``num_blocks`` and ``block_size`` (``state``).

Both name the worker ``generation`` they expect (hello reports it per worker; a
mismatch is STATE_LOST: the worker restarted and the cache is gone). The reply is a
:class:`~graphlane.protocol.ops.steps.DeviceResult`: ``outputs`` empty for ``kv_write``,
``key``/``value`` for ``kv_read``; ``generation`` the worker's.
"""

from __future__ import annotations

from msgspec import Struct

from graphlane.protocol.bounds import Count, Name
from graphlane.protocol.ops.steps import Deadline
from graphlane.protocol.tensors import Tensor, take_tensor


class KvWrite(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Write ``key``/``value`` [layers, n, num_kv_heads, head_dim] (the program's dtype)
    into ``slots`` [n] (int64 or int32, distinct, each < num_blocks * block_size), all
    layers at once: a prompt's KV that a prefill elsewhere produced."""

    program: Name
    device: Count
    slots: Tensor
    key: Tensor
    value: Tensor
    generation: Count | None = None
    timeout_ms: Deadline | None = None

    def __post_init__(self) -> None:
        take_tensor(self, "slots")
        take_tensor(self, "key")
        take_tensor(self, "value")


class KvRead(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Read back ``key``/``value`` [layers, n, num_kv_heads, head_dim] of ``slots`` [n]."""

    program: Name
    device: Count
    slots: Tensor
    generation: Count | None = None
    timeout_ms: Deadline | None = None

    def __post_init__(self) -> None:
        take_tensor(self, "slots")


class Resume(Struct, frozen=True, forbid_unknown_fields=True):
    """Acknowledge the failure of a request that changes device state: the worker
    refuses this connection's requests to stateful programs (PREDECESSOR_FAILED) from
    that failure until this arrives, so that nothing sent behind the failed request,
    before its sender saw the failure, runs on state it did not apply. The reply is a
    map: ``resumed``, the id of the failed request (None if nothing was refused)."""

    device: Count
