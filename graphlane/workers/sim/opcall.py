"""One device op call, as a stream runs it: the op and its CPU-level arguments."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class OpCall:
    """``op(*args, **kwargs)`` over CPU tensors that alias the device tensors' storage.

    ``outs`` holds the CPU storage allocated for a functional op's results when
    it was issued; running the call copies the results there, so that the
    tensors handed to the host at issue time receive them.
    """

    __slots__ = ("args", "kwargs", "label", "op", "outs")

    def __init__(
        self,
        op: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outs: list[torch.Tensor] | None = None,
    ) -> None:
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.outs = outs
        self.label = str(getattr(op, "__name__", op))

    def execute(self) -> Any:
        result = self.op(*self.args, **self.kwargs)
        if self.outs is not None:
            flat, _ = tree_flatten(result)
            produced = [r for r in flat if isinstance(r, torch.Tensor)]
            for dst, src in zip(self.outs, produced, strict=True):
                dst.copy_(src)
        return result

    def tensor_keys(self) -> list[tuple[Any, ...]]:
        flat, _ = tree_flatten((self.args, self.kwargs))
        keys = [_tensor_key(t) for t in flat if isinstance(t, torch.Tensor)]
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
