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
  numpy arrays in ``inputs`` are viewed as tensors (:func:`as_tensors`);
* without ``batch=``, the batch size is the length of the program's
  ``batch_param`` as ``hello`` describes the program (:func:`infer_batch`); a
  parameter that is missing or misspelt is reported by its name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from graphlane.protocol.errors import BadRequest, UnknownProgram

__all__ = [
    "BatchParams",
    "InvalidArgument",
    "as_params",
    "as_tensors",
    "call_timeout",
    "check_device",
    "check_timeout",
    "deadline_ms",
    "infer_batch",
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
    return max(1, int(call_timeout(default, timeout) * 1000))


def as_params(params: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(params, Mapping):
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


def as_tensors(inputs: Mapping[str, Any] | None) -> dict[str, torch.Tensor]:
    """Input tensors (numpy arrays are viewed as tensors, without a copy)."""
    if not inputs:
        return {}
    out = {}
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value))
        out[name] = value
    return out
