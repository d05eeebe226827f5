"""One device op call, as a stream runs it: the op and its CPU-level arguments."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

# Custom device ops that graph updates re-issue (registered by ops.py): a task of
# one of these re-issued eagerly with its captured tensors was meant as an update.
PATCHABLE_OPS: set[Any] = set()

# Op arguments are values or lists/tuples of values (a schema's Tensor[] or int[]);
# these one-level walks replace torch's pytree, which costs ~10x more per call.


def map_value(fn: Callable[[Any], Any], v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return type(v)(fn(e) for e in v)
    return fn(v)


def map_args(fn: Callable[[Any], Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(map_value(fn, a) for a in args)


def map_kwargs(fn: Callable[[Any], Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: map_value(fn, v) for k, v in kwargs.items()}


def flat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    for v in (*args, *kwargs.values()):
        if isinstance(v, (list, tuple)):
            yield from v
        else:
            yield v


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class OpCall:
    """``op(*args, **kwargs)`` over CPU tensors that alias the device tensors' storage.

    ``outs`` holds the CPU storage allocated for a functional op's results when
    it was issued; running the call copies the results there, so that the
    tensors handed to the host at issue time receive them.
    """

    __slots__ = ("args", "host", "kwargs", "label", "op", "outs")

    def __init__(
        self,
        op: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outs: list[torch.Tensor] | None = None,
        host: set[int] | None = None,
    ) -> None:
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.outs = outs
        # ids of host tensors among the arguments: values a patch may change, not memory
        self.host = host or set()
        self.label = str(getattr(op, "__name__", op))

    def execute(self) -> Any:
        result = self.op(*self.args, **self.kwargs)
        if self.outs is not None:
            values = result if isinstance(result, (list, tuple)) else (result,)
            produced = [r for r in values if isinstance(r, torch.Tensor)]
            for dst, src in zip(self.outs, produced, strict=True):
                dst.copy_(src)
        return result

    def tensor_keys(self) -> list[tuple[Any, ...]]:
        keys = [
            _tensor_key(t)
            for t in flat(self.args, self.kwargs)
            if isinstance(t, torch.Tensor) and id(t) not in self.host
        ]
        keys += [_tensor_key(t) for t in self.outs or ()]
        return keys

    def mismatch(self, other: OpCall) -> str:
        """Why ``other`` cannot patch this captured call ('' when it can)."""
        if other.op is not self.op:
            return f"op {other.label} instead of {self.label}"
        mine, theirs = self.tensor_keys(), other.tensor_keys()
        if len(mine) != len(theirs):
            return f"{len(theirs)} tensor arguments instead of {len(mine)}"
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            if a[2:] != b[2:]:
                return f"tensor argument {i} has shape/stride/dtype {b[2:]} instead of {a[2:]}"
            if a[:2] != b[:2]:
                return (
                    f"tensor argument {i} is another tensor than the captured one (a patch "
                    "changes parameters, not tensor addresses: copy new data into the "
                    "captured buffers instead)"
                )
        return ""
