"""The engine's own check of a step's inputs against the static buffers they go into.

A program's ``plan`` may leave its inputs unchecked (a program written to try
something out, or one that forgets): copying a tensor of the wrong shape or
dtype into a static buffer would then fail on the device path, after the replay
was launched, and take the worker down. The engine knows every buffer's shape
and dtype, so before a step is accepted it asks the program where each input
goes (:meth:`GraphProgram.input_writes` on the bucket's first instance; every
instance of a bucket has the same buffers) and refuses a mismatch, an input the
program does not place, or a placement that fails, as a StepError naming the
input (BAD_REQUEST on the wire). Programs that check their inputs in ``plan``
set ``checks_inputs`` and skip this (the built-in attention program does).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graphlane.workers.programs.base import GraphProgram, StepError, StepPlan

__all__ = ["check_inputs"]


def _name_of(src: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> str:
    for name, t in inputs.items():
        if src is t or src._base is t or (t._base is not None and src._base is t._base):
            return f"inputs.{name}"
    return "inputs"


def check_inputs(program: GraphProgram, buffers: dict[str, torch.Tensor], plan: StepPlan) -> None:
    """StepError naming the input unless every input of ``plan`` fits its buffer."""
    for name, t in plan.inputs.items():
        if not isinstance(t, torch.Tensor):
            raise StepError(f"inputs.{name}", f"must be a tensor, not {type(t).__name__}")
    used: set[str] = set()
    for group in range(program.num_groups):
        try:
            writes = program.input_writes(buffers, plan, group)
        except KeyError as exc:
            key = exc.args[0] if exc.args else None
            where = f"inputs.{key}" if key in plan.inputs else "inputs"
            raise StepError(
                where,
                f"program {program.name!r} has no static buffer {key!r} for it "
                f"(buffers: {sorted(buffers)})",
            ) from None
        except Exception as exc:
            raise StepError(
                "inputs", f"program {program.name!r} could not place its inputs: {exc}"
            ) from None
        for dst, src in writes:
            where = _name_of(src, plan.inputs)
            used.add(where)
            if tuple(src.shape) != tuple(dst.shape):
                raise StepError(
                    where,
                    f"shape {list(src.shape)} does not fit its static buffer "
                    f"{list(dst.shape)} (batch {plan.batch})",
                )
            if src.dtype != dst.dtype:
                raise StepError(where, f"dtype {src.dtype} instead of {dst.dtype}")
    unused = [n for n in plan.inputs if f"inputs.{n}" not in used]
    if unused and "inputs" not in used:
        raise StepError(
            f"inputs.{unused[0]}", f"not an input of program {program.name!r} (it is not used)"
        )
