"""``Tensor.record_stream`` on the simulated NPU.

torch_npu's ``record_stream(self, stream)`` unpacks the stream as an NPU stream and
tells the caching allocator that the tensor's block is used on it
(``NPUCachingAllocator::recordStream``: the block is not reused until work queued on
that stream so far has finished). The sim accepts the same arguments, refuses a stream
that is not an npu stream, and records the use per allocation: :func:`stream_uses`
gives the streams recorded for the allocation a tensor views.
"""

from __future__ import annotations

import weakref
from typing import Any

from . import allocation
from .errors import SimUsageError
from .streams import Stream, as_stream

# Allocation (what an npu tensor and its views hold of their memory: the caching
# allocator's handle, or for memory it did not give, the host storage) -> streams.
_uses: weakref.WeakKeyDictionary[Any, set[Stream]] = weakref.WeakKeyDictionary()


def _allocation(t: Any) -> Any:
    alloc = t._alloc
    return alloc if alloc is not None else t._data.untyped_storage()


def record_stream(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``aten::record_stream(Tensor(a!) self, Stream s)`` of an npu tensor."""
    t = args[0]
    s = args[1] if len(args) > 1 else kwargs["s"]
    try:
        stream = as_stream(s)
    except TypeError:
        raise SimUsageError(
            f"record_stream of an npu tensor needs an npu stream, got {s!r} (torch_npu "
            "unpacks it as an NPUStream)"
        ) from None
    _uses.setdefault(_allocation(t), set()).add(stream)
    allocation.record_stream(t, stream)  # the allocator holds the block back at its free


def stream_uses(t: Any) -> frozenset[Stream]:
    """The streams ``record_stream`` recorded for the allocation ``t`` views."""
    return frozenset(_uses.get(_allocation(t), ()))
