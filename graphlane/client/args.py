"""The client's checks and conversions of a call's arguments, before anything is sent.

A caller's mistake is answered at the call, in one line naming the argument:

* ``device`` must be an int (or ``(host, device)`` with several hosts): a string
  such as ``"0"`` is an :class:`InvalidArgument` (a TypeError too), not a
  device "not served";
* ``timeout`` must be a positive number of seconds: 0, a negative number or NaN
  is an :class:`InvalidArgument` (a ValueError too), not a TIMEOUT that says to
  retry; it is also the worker's deadline for the call (:func:`deadline_ms`);
* numpy values, as schedulers have them, are accepted: the wire's encoder makes
  numpy integers and floats Python numbers and numpy arrays in ``params`` lists;
  numpy arrays in ``inputs`` are viewed as tensors (:func:`as_tensors`); anything
  else as an input (a list of floats: its dtype would be a guess) is refused naming it;
* sequence ids and block numbers (``add_sequence``, ``decode``, ``append_blocks``,
  ``free_sequences``) are ints (numpy integers too) in their range: a float, a string
  or a bool is refused naming the argument, never rounded (:func:`as_ids`);
* KV cache ``slots`` are what a scheduler has at hand: a list of ints, or a 1-D
  integer tensor or numpy array (:func:`as_slots`);
* ``outputs`` defaults to every output of the program as ``hello`` describes it; a
  single name may be a plain string (:class:`ProgramOutputs`, :func:`output_names`);
* without ``batch=``, the batch size is the length of the program's
  ``batch_param`` as ``hello`` describes the program (:func:`infer_batch`); a
  parameter that is missing or misspelt is reported by its name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from graphlane.protocol.errors import BadRequest, UnknownProgram

__all__ = [
    "BatchParams",
    "InvalidArgument",
    "ProgramOutputs",
    "as_id",
    "as_ids",
    "as_params",
    "as_slots",
    "as_tensor",
    "as_tensors",
    "call_timeout",
    "check_device",
    "check_timeout",
    "deadline_ms",
    "infer_batch",
    "output_names",
]


class InvalidArgument(BadRequest, TypeError, ValueError):
    """An argument of a client call that cannot be right (a TypeError and a ValueError
    too, and a BAD_REQUEST GraphlaneError); the message names the argument."""


def check_device(device: object) -> None:
    if type(device) is int:
        if device < 0:
            raise InvalidArgument(f"device must be a device id >= 0, not {device}")
        return
    if isinstance(device, tuple) and len(device) == 2:
        check_device(device[1])
        return
    if isinstance(device, np.integer):
        return
    hint = " (an int, e.g. device=0)" if isinstance(device, str) and device.isdigit() else ""
    raise InvalidArgument(
        f"device must be an int device id or (host, device), not {type(device).__name__} "
        f"{device!r}{hint}"
    )


def check_timeout(timeout: object) -> None:
    if timeout is None:
        return
    if (
        not isinstance(timeout, (int, float))
        or isinstance(timeout, bool)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise InvalidArgument(
            f"timeout must be a positive number of seconds (or None for the client's "
            f"default), not {timeout!r}"
        )


class BatchParams:
    """The batch parameter of each (device, program) of one daemon's ``hello``, cached
    until the hello changes: inferring a step's batch costs a dict lookup."""

    def __init__(self) -> None:
        self._hello: object = None
        self._names: dict[tuple[int, str], str] = {}

    def infer(
        self, hello: Mapping[str, Any], device: int, program: str, params: Mapping[str, Any]
    ) -> int | None:
        if hello is self._hello:
            name = self._names.get((device, program))
            if name is not None:
                value = params.get(name)
                if type(value) is list:
                    return len(value)
        else:
            self._hello, self._names = hello, {}
        entry = next((w for w in hello.get("workers", ()) if w.get("device") == device), None)
        batch = infer_batch(program, params, entry, f"on device {device}")
        name = ((entry or {}).get("programs") or {}).get(program, {}).get("batch_param")
        if isinstance(name, str):
            self._names[(device, program)] = name
        return batch


def infer_batch(
    program: str, params: Mapping[str, Any], described: Mapping[str, Any] | None, where: str
) -> int | None:
    """The batch size of a step without ``batch=``: the length of the program's
    ``batch_param``. None when the daemon does not describe the program's batch
    parameter (the server then infers it). BadRequest naming the parameter when it
    is missing or misspelt; UnknownProgram when the worker does not serve it."""
    if described is None:
        return None
    programs = described.get("programs") or {}
    if program not in programs:
        raise UnknownProgram(
            f"program {program!r} is not served {where} (serving {sorted(programs)})"
        )
    info = programs[program]
    name = info.get("batch_param")
    known = list(info.get("parameters") or ())
    if not isinstance(params, Mapping):
        raise BadRequest(
            f"params must be a mapping of parameter names, not {type(params).__name__}"
        )
    unknown = [k for k in params if known and k not in known]
    if unknown:
        raise BadRequest(f"params.{unknown[0]}: unknown parameter of {program!r} (known: {known})")
    if "batch_param" not in info:
        return None  # an older daemon: it infers the batch itself
    if name is None:
        raise BadRequest(
            f"batch: program {program!r} has no batch parameter; pass batch= to the call"
        )
    if name not in params:
        raise BadRequest(f"params.{name}: missing (the batch size is its length; or pass batch=)")
    value = params[name]
    if isinstance(value, (list, tuple, np.ndarray, torch.Tensor)):
        return len(value)
    raise BadRequest(
        f"params.{name}: must be a list with one entry per batch row, not {type(value).__name__}"
    )


def call_timeout(default: float, timeout: float | None) -> float:
    if timeout is None:
        return default
    check_timeout(timeout)  # 0 or negative: refused here, not a retryable TIMEOUT
    return float(timeout)


def deadline_ms(default: float, timeout: float | None) -> int:
    """The call's deadline for the worker: a step not yet issued by then is answered
    TIMEOUT without running (its caller has given up on it)."""
    ms = int((default if timeout is None else call_timeout(default, timeout)) * 1000)
    return ms if ms > 1 else 1  # (not max(): a call per step that parses its arguments)


def as_params(params: Mapping[str, Any]) -> dict[str, Any]:
    if type(params) is not dict and not isinstance(params, Mapping):  # (dict: no abc check)
        raise InvalidArgument(f"params must be a mapping, got {type(params).__name__}")
    for name, value in params.items():
        if type(value) in _SENT_AS_IS:  # the common case: a list, a number, a string
            continue
        if isinstance(value, set | frozenset | dict | bytes | bytearray):
            # msgpack would send a set as a list in no particular order: refuse it here
            raise InvalidArgument(
                f"params.{name}: cannot send a value of type {type(value).__name__} "
                "(a number, a string or a list of numbers)"
            )
    return dict(params)


_SENT_AS_IS = frozenset((list, int, float, str, bool, type(None), tuple))


def as_tensors(inputs: Mapping[str, Any] | None, what: str = "inputs") -> dict[str, torch.Tensor]:
    """Input tensors (numpy arrays are viewed as tensors, without a copy); anything else
    is an InvalidArgument naming ``what.NAME``."""
    if not inputs:
        return {}
    if type(inputs) is dict:  # the common case: a dict of torch tensors, as they are
        for v in inputs.values():
            if type(v) is not torch.Tensor:
                break
        else:
            return dict(inputs)
    if not isinstance(inputs, Mapping):
        raise InvalidArgument(
            f"{what} must be a mapping of input names to tensors, not {type(inputs).__name__}"
        )
    return {name: as_tensor(value, f"{what}.{name}") for name, value in inputs.items()}


def as_tensor(value: Any, what: str) -> torch.Tensor:
    """A torch tensor, or a numpy array viewed as one; InvalidArgument naming ``what``
    for anything else (a list of floats has no dtype: the program's is not guessed)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    raise InvalidArgument(
        f"{what}: must be a torch.Tensor or a numpy array, not {type(value).__name__}"
    )


def as_slots(slots: Any, what: str = "slots") -> torch.Tensor:
    """KV cache slot numbers [n] as an integer tensor: a list, tuple or range of ints, or
    a 1-D integer tensor or numpy array; InvalidArgument naming ``what`` otherwise."""
    if isinstance(slots, (list, tuple, range)):
        bad = next((x for x in slots if not _is_int(x)), None)
        if bad is not None:
            raise InvalidArgument(
                f"{what}: slot numbers are ints, got {type(bad).__name__} {bad!r} in the list"
            )
        return torch.tensor([int(x) for x in slots], dtype=torch.int64)
    if not isinstance(slots, (torch.Tensor, np.ndarray)):
        raise InvalidArgument(
            f"{what}: must be a list of ints or a 1-D integer tensor or numpy array, "
            f"not {type(slots).__name__}"
        )
    t = as_tensor(slots, what)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidArgument(f"{what}: slot numbers are integers, not {t.dtype}")
    if t.dim() != 1:
        raise InvalidArgument(f"{what}: must be 1-D [n], not of shape {list(t.shape)}")
    return t if t.dtype in (torch.int64, torch.int32) else t.to(torch.int64)


def as_ids(values: Any, what: str, most: int | None = None) -> list[int]:
    """Sequence ids or block numbers (a list, tuple or range of ints >= 0, at most
    ``most``) as a list of ints; InvalidArgument naming ``what`` otherwise: ``int()``
    would turn 1.7 into sequence 1 and "3" into sequence 3."""
    if not isinstance(values, (list, tuple, range)):
        raise InvalidArgument(f"{what}: must be a list of ints, not {type(values).__name__}")
    # The common case (plain ints in range, as every decode step sends) checked whole,
    # without a per-id call and message; anything else is looked at id by id below.
    # (sorted: one call, where min and max are two, each parsing its arguments by name)
    ids = list(values)
    if set(map(type, ids)) <= _INT and (
        not ids or ((s := sorted(ids))[0] >= 0 and (most is None or s[-1] <= most))
    ):
        return ids
    return [as_id(v, f"{what}[{i}]", most) for i, v in enumerate(ids)]


_INT = frozenset((int,))  # (exactly int: a bool is not an id, a numpy int is looked at below)


def as_id(value: Any, what: str, most: int | None = None) -> int:
    """One sequence id or block number: an int >= 0 (at most ``most``)."""
    if not _is_int(value):
        raise InvalidArgument(f"{what}: must be an int, not {type(value).__name__} {value!r}")
    v = int(value)
    if v < 0 or (most is not None and v > most):
        within = f"in 0..{most}" if most is not None else ">= 0"
        raise InvalidArgument(f"{what}: must be {within}, not {v}")
    return v


def _is_int(x: object) -> bool:
    return (isinstance(x, int) and not isinstance(x, bool)) or isinstance(x, np.integer)


def output_names(outputs: str | Sequence[str]) -> list[str]:
    """The outputs a step or replay names: a list of names, or one name as a string."""
    if type(outputs) is list or type(outputs) is tuple:  # the common cases, before the
        return list(outputs)  # abstract Sequence check
    if isinstance(outputs, str):
        return [outputs]
    if not isinstance(outputs, Sequence):
        raise InvalidArgument(
            f"outputs must be a list of output names, not {type(outputs).__name__}"
        )
    return list(outputs)


class ProgramOutputs:
    """What a step or replay that names no outputs asks for: every output of the
    program as one daemon's ``hello`` describes it on the device (none when it is not
    described: the worker then names what is wrong), cached until the hello changes."""

    def __init__(self) -> None:
        self._hello: object = None
        self._names: dict[tuple[int, str], list[str]] = {}

    def of(self, hello: Mapping[str, Any], device: int, program: str) -> list[str]:
        """The names (a shared list: not to be changed)."""
        if hello is not self._hello:
            self._hello, self._names = hello, {}
        names = self._names.get((device, program))
        if names is None:
            names = []
            for w in hello.get("workers", ()):
                if w.get("device") == device:
                    described = (w.get("programs") or {}).get(program)
                    if isinstance(described, Mapping):
                        names = [str(n) for n in described.get("outputs") or ()]
            self._names[(device, program)] = names
        return names
