"""``prefill``: run one sequence's prompt through a model program into its KV cache.

A device-state operation of the ``model`` program (docs/models.md), answered by the
device's worker in order with the replays of the program's graphs, as ``kv_write``:
a prefill sent before a step is seen by it. ``tokens`` [n] (int64 or int32) are the
prompt's tokens from position ``start`` (0, or how many of the sequence's tokens are
in the cache already: a scheduler that chunks prompts itself sends the rest with a
later ``start``); ``block_table`` int32 [max_blocks_per_seq] names the sequence's
blocks; ``params`` its sampling settings, one value each (``temperature``, ``top_k``,
``top_p``, ``seed``; default greedy). The reply is a
:class:`~graphlane.protocol.ops.steps.DeviceResult` whose ``outputs`` hold ``tokens`` [1]
(the first sampled token) and whichever of ``logprobs``, ``logprob_ids``, ``logits``
``outputs`` names. ``generation`` as for ``kv_write`` (STATE_LOST after a restart).
"""

from __future__ import annotations

from msgspec import Struct

from graphlane.protocol.bounds import Count, Name
from graphlane.protocol.ops.steps import Deadline, Outputs, Params
from graphlane.protocol.tensors import Tensor, take_tensor


class Prefill(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Run ``tokens`` [n] from position ``start`` into the cache of ``block_table``."""

    program: Name
    device: Count
    tokens: Tensor
    block_table: Tensor
    start: Count = 0
    params: Params = {}
    outputs: Outputs = []
    generation: Count | None = None
    timeout_ms: Deadline | None = None

    def __post_init__(self) -> None:
        take_tensor(self, "tokens")
        take_tensor(self, "block_table")
