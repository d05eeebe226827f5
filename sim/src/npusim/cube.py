"""Float16 matrix products as the NPU's Cube unit computes them: float16 inputs, the
products accumulated in float32, the result rounded once to float16.

torch's CPU kernels compute float16 matrix products that way too (the same numbers: a
float32 accumulator rounded once), but without native float16 arithmetic the CPU's
float16 GEMM is about 250 times slower than its float32 one (a 640x4096 by 4096x2048
product: a minute against a quarter of a second on the machine this was measured on),
which makes autocast training on the sim unusable at the sizes of upstream's tests. The
sim computes these ops in float32 and rounds the result to float16.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

#: The matrix products run this way (``linear`` and ``matmul`` decompose into them).
GEMMS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.mv.default,
        aten.addmv.default,
        aten.addbmm.default,
    }
)


def _up(v: Any) -> Any:
    return v.float() if isinstance(v, torch.Tensor) and v.dtype is torch.float16 else v


def run(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``op(*args, **kwargs)``; a float16 product accumulates in float32."""
    if not any(isinstance(a, torch.Tensor) and a.dtype is torch.float16 for a in args):
        return op(*args, **kwargs)
    result = op(*(_up(a) for a in args), **{k: _up(v) for k, v in kwargs.items()})
    return result.to(torch.float16)
