"""Binding against the wheel's signatures, the per-thread device rule and the trace."""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import os
import threading
from pathlib import Path
from typing import Any

import torch

API: dict[str, Any] = json.loads(Path(__file__).with_name("api_2.14.0.json").read_text())


class StrictError(RuntimeError):
    """A call the real torch_npu would refuse (or that would misbehave on the NPU)."""


# ------------------------------------------------------------------ signatures
def _default(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except ValueError:
        return text  # a name (e.g. a constant of the wheel's): only its presence matters


def signature(params: list[dict[str, Any]]) -> inspect.Signature:
    out = []
    for p in params:
        default = _default(p["default"]) if "default" in p else inspect.Parameter.empty
        out.append(inspect.Parameter(p["name"], getattr(inspect.Parameter, p["kind"]),
                                     default=default))  # fmt: skip
    return inspect.Signature(out)


PYTHON = {name: signature(params) for name, params in API["python"].items()}


def schema_signature(schema: str) -> inspect.Signature:
    """A registered op schema's arguments as a Python signature."""
    parsed = torch._C.parse_schema(schema)
    out = []
    for a in parsed.arguments:
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        if a.kwarg_only:
            kind = inspect.Parameter.KEYWORD_ONLY
        default = a.default_value if a.has_default_value() else inspect.Parameter.empty
        out.append(inspect.Parameter(a.name, kind, default=default))
    return inspect.Signature(out)


def parser_signature(text: str, leading: tuple[str, ...]) -> inspect.Signature:
    """A PythonArgParser signature (C++ types) after ``leading`` positional arguments."""
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in leading]
    inner = text[text.index("(") + 1 : text.rindex(")")]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    for part in (p.strip() for p in inner.split(",")):
        if part == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        decl, _, default = part.partition("=")
        value = _default(default) if default else inspect.Parameter.empty
        params.append(inspect.Parameter(decl.split()[-1], kind, default=value))
    return inspect.Signature(params)


def bind(name: str, sig: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"torch_npu 2.14 {name}{sig}: {exc}") from None


# ------------------------------------------------------------------ device visibility
def visible_devices() -> list[int] | None:
    raw = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [int(p) for p in raw.split(",") if p.strip()]


class _ThreadDevice(threading.local):
    def __init__(self) -> None:
        self.set = False


THREAD = _ThreadDevice()


def require_device(name: str) -> None:
    if not THREAD.set:
        raise StrictError(
            f"{name} on thread {threading.current_thread().name!r}, which never set the "
            "device: torch_npu's current device is per host thread (call "
            "torch_npu.npu.set_device in every thread that touches the device)"
        )


# ------------------------------------------------------------------ trace
_DIR = os.environ.get("STRICT_TORCH_NPU_TRACE")
_lock = threading.Lock()
_file: Any = None
_handles: dict[int, tuple[Any, int]] = {}
_handle_ids = itertools.count(1)


def ref(v: Any) -> Any:
    """A value as the trace names it: streams, events, graphs and handles by identity."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.Tensor):
        return "tensor"
    if isinstance(v, torch.device):
        return str(v)
    if isinstance(v, torch.Stream):
        return {"stream": v.stream_id, "device": v.device_index}
    if isinstance(v, (list, tuple)):
        return [ref(x) for x in v[:64]]
    if isinstance(v, dict):
        return {str(k): ref(x) for k, x in v.items()}
    name = getattr(v, "name", None)
    if isinstance(name, str):  # sim events and graphs carry their names
        return name
    if type(v).__name__ == "TaskGroupHandle":
        held = _handles.get(id(v))
        if held is None or held[0] is not v:
            held = _handles[id(v)] = (v, next(_handle_ids))
        return f"handle#{held[1]}"
    return type(v).__name__


def trace(call: str, arguments: dict[str, Any], **extra: Any) -> None:
    if _DIR is None:
        return
    entry = {"call": call, "thread": threading.current_thread().name,
             "args": {k: ref(v) for k, v in arguments.items() if k not in ("self", "cls")},
             **extra}  # fmt: skip
    if "self" in arguments:
        entry["self"] = ref(arguments["self"])
    line = json.dumps(entry)
    global _file
    with _lock:
        if _file is None:
            _file = open(os.path.join(_DIR, f"trace-{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115
            header = {"call": "#process", "pid": os.getpid(), "visible": visible_devices()}
            _file.write(json.dumps(header) + "\n")
        _file.write(line + "\n")


# ------------------------------------------------------------------ wrappers
def function(name: str, impl: Any, *, device: bool = True) -> Any:
    """``impl`` (the sim's) behind the wheel's signature of ``name``."""
    sig = PYTHON[name]

    def strict(*args: Any, **kwargs: Any) -> Any:
        bound = bind(name, sig, args, kwargs)
        if device:
            require_device(name)
        trace(name, dict(bound.arguments))
        return impl(*args, **kwargs)

    strict.__name__ = strict.__qualname__ = name.rpartition(".")[2]
    strict.__signature__ = sig  # type: ignore[attr-defined]
    return strict
