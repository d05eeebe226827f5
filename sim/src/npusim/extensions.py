"""Sim extensions: things the NPU does not do, turned on by name, off by default.

An extension lets a program do on the sim what torch_npu 2.14 on an Atlas A2 refuses,
for a purpose of the sim's own (an exact float32 reference). It is not the NPU's: code
that needs one will not run on a device. A captured graph's profile
(:func:`npusim.graph_profile`) names the extensions its tasks used.

    npusim.extensions.enable("float32_attention")          # for the process
    with npusim.extensions.enabled("float32_attention"):   # for a block
        ...
    NPUSIM_EXTENSIONS=float32_attention                     # read when npusim is imported

Known extensions (:data:`KNOWN`):

- ``float32_attention``: the fused attention ops (``npu_fused_infer_attention_score``,
  its v2 and ``.out`` overloads, ``_npu_paged_attention``) accept float32 query, key
  and value and compute in float32. Their documentation allows float16, bfloat16 and
  int8 only, and a device refuses float32.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from .errors import SimUsageError

#: Every extension, with what it allows.
KNOWN: dict[str, str] = {
    "float32_attention": (
        "fused attention ops accept float32 inputs and compute in float32, an exact "
        "reference (torch_npu's kernels take float16, bfloat16 and int8 only)"
    ),
}

ENV_VAR = "NPUSIM_EXTENSIONS"

# The extensions on, process-wide; read on every checked op, so a frozenset swapped
# whole (readers need no lock).
ON: frozenset[str] = frozenset()
_lock = threading.Lock()


def _checked(names: Iterable[str]) -> frozenset[str]:
    out = frozenset(names)
    unknown = sorted(out - KNOWN.keys())
    if unknown:
        raise SimUsageError(
            f"unknown npusim extension {', '.join(map(repr, unknown))}: the known ones are "
            f"{', '.join(sorted(KNOWN))}"
        )
    return out


def parse(value: str) -> frozenset[str]:
    """The extensions a ``NPUSIM_EXTENSIONS`` value names (comma- or space-separated)."""
    return _checked(n for n in value.replace(",", " ").split() if n)


def enable(*names: str) -> None:
    """Turn the named extensions on for this process."""
    global ON
    add = _checked(names)
    with _lock:
        ON = ON | add


def disable(*names: str) -> None:
    """Turn the named extensions off (a name that is off is left so)."""
    global ON
    drop = _checked(names)
    with _lock:
        ON = ON - drop


def is_enabled(name: str) -> bool:
    """Whether extension ``name`` is on."""
    return name in ON


def active() -> frozenset[str]:
    """The extensions on now."""
    return ON


@contextmanager
def enabled(*names: str) -> Iterator[None]:
    """The named extensions on inside the block; each one that was off before is off
    again after it."""
    global ON
    add = _checked(names)
    with _lock:
        was = ON
        ON = ON | add
    try:
        yield
    finally:
        with _lock:
            ON = ON - (add - was)
