"""Typed request bodies, one frozen class per operation.

Each class is the spec of its operation's body: its fields are the body's keys,
``from_body`` validates a decoded body (an unknown key, a missing required key
or a wrong type raises :class:`~graphlane.protocol.errors.BadRequest` naming
``body.<field>``) and ``to_body`` gives the map to encode. Constructing a class
directly runs the same checks, so a client cannot build a body the server would
refuse for its shape.

The codec has already enforced sizes, nesting and tensor layout; these classes
check meaning: which keys exist, their types and ranges.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self, TypeAlias, TypeVar

import torch

from graphlane.protocol.codec import encode_request
from graphlane.protocol.errors import BadRequest

__all__ = [
    "MAX_OUTPUTS",
    "MESSAGES",
    "DrainRequest",
    "Hello",
    "Message",
    "ReplayRequestMsg",
    "ShutdownRequest",
    "StatusRequest",
    "StepRequestMsg",
    "UpdateRequestMsg",
    "encode_message",
    "parse_body",
]

MAX_OUTPUTS = 16
"""Most output names a step or replay may ask for."""

BATCH_PARAM = "actual_seq_lengths_kv"
"""The parameter whose length gives ``batch`` when a step or update omits it."""


T = TypeVar("T")

# ------------------------------------------------------------------------- field checks


def _str(value: Any, name: str, *, non_empty: bool = False) -> str:
    if type(value) is str and (value or not non_empty):  # the common case first
        return value
    if not isinstance(value, str) or (non_empty and not value):
        kind = "a non-empty str" if non_empty else "a str"
        raise BadRequest(f"body.{name}: must be {kind}, got {_type(value)}")
    return value


def _int(value: Any, name: str, *, minimum: int) -> int:
    if type(value) is int and value >= minimum:  # the common case first
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"body.{name}: must be an int >= {minimum}, got {_show(value)}")
    return value


def _optional_int(value: Any, name: str, *, minimum: int) -> int | None:
    return None if value is None else _int(value, name, minimum=minimum)


def _params(value: Any, name: str) -> dict[str, Any]:
    if type(value) is dict and all(type(key) is str for key in value):  # the decoder's maps
        return dict(value)
    if not isinstance(value, Mapping):
        raise BadRequest(f"body.{name}: must be a map, got {_type(value)}")
    for key in value:
        if not isinstance(key, str):
            raise BadRequest(f"body.{name}: keys must be str, got {_type(key)}")
    return dict(value)


def _tensors(value: Any, name: str) -> dict[str, torch.Tensor]:
    if type(value) is dict and not value:  # no inputs: the common case
        return {}
    tensors = _params(value, name)
    for key, item in tensors.items():
        if not isinstance(item, torch.Tensor):
            raise BadRequest(f"body.{name}.{key}: must be a tensor, got {_type(item)}")
    return tensors


def _names(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise BadRequest(f"body.{name}: must be a list of str, got {_type(value)}")
    if len(value) > MAX_OUTPUTS:
        raise BadRequest(f"body.{name}: {len(value)} names, at most {MAX_OUTPUTS} allowed")
    for i, item in enumerate(value):
        if type(item) is not str or not item:  # the path is only formatted for a bad one
            _str(item, f"{name}[{i}]", non_empty=True)
    if len(set(value)) != len(value):
        raise BadRequest(f"body.{name}: names must be unique, got {list(value)}")
    return tuple(value)


def _type(value: Any) -> str:
    return "nil" if value is None else type(value).__name__


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, int) else _type(value)


def _set(obj: object, **values: Any) -> None:
    """Store normalized field values on a frozen instance (only from ``__post_init__``)."""
    for name, value in values.items():
        object.__setattr__(obj, name, value)


class _Body:
    """Reads a body map for one message class: rejects unknown keys, reports missing ones."""

    _known: ClassVar[dict[type[Any], frozenset[str]]] = {}

    def __init__(self, cls: type[Any], body: Mapping[str, Any]) -> None:
        self.body = body
        known = self._known.get(cls)
        if known is None:
            known = self._known[cls] = frozenset(f.name for f in fields(cls))
        if type(body) is dict and body.keys() <= known:  # a decoded body of known fields
            return
        if not isinstance(body, Mapping):
            raise BadRequest(f"body: must be a map, got {_type(body)}")
        for key in body:
            if key not in known:
                known_list = [f.name for f in fields(cls)]
                name = str(key) if len(str(key)) <= 64 else f"{str(key)[:61]}..."
                raise BadRequest(
                    f"body.{name}: unknown field of {cls.OP!r} (known: {known_list})"
                )

    def required(self, name: str) -> Any:
        if name not in self.body:
            raise BadRequest(f"body.{name}: missing required field")
        return self.body[name]

    def optional(self, name: str, default: Any) -> Any:
        return self.body.get(name, default)

    def batch(self) -> Any:
        """``batch``, or the length of ``params.actual_seq_lengths_kv`` when it is absent."""
        if "batch" in self.body:
            return self.body["batch"]
        params = self.body.get("params")
        lengths = params.get(BATCH_PARAM) if isinstance(params, Mapping) else None
        if not isinstance(lengths, list | tuple):
            given = sorted(map(str, params)) if isinstance(params, Mapping) else []
            raise BadRequest(
                f"body.batch: missing, and not inferable (body.params.{BATCH_PARAM} is not a "
                f"list; params given: {given})"
            )
        return len(lengths)


def _wire(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


class _Message:
    """Shared ``to_body``: every field, except optional ones left at None."""

    OP: ClassVar[str]

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            body[f.name] = _wire(value)
        return body


# ----------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Hello(_Message):
    """``hello``: who is calling; the reply says what the server can do.

    Body: ``{"client": str}`` (optional, free text for logs).
    Reply body (a free-form map, for people and feature checks):
    ``{"version": 1, "server": str, "capabilities": {...}, "workers": [...]}``.
    """

    OP: ClassVar[str] = "hello"
    client: str = ""

    def __post_init__(self) -> None:
        _str(self.client, "client")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Body(cls, body)
        return cls(client=r.optional("client", ""))


@dataclass(frozen=True)
class StatusRequest(_Message):
    """``status``: the daemon's state, its workers and counters. Body: ``{}``."""

    OP: ClassVar[str] = "status"

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        _Body(cls, body)
        return cls()


def _checked_patch_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """The fields ``step`` and ``update`` share, validated (BadRequest names the field)."""
    return {
        "program": _str(values["program"], "program", non_empty=True),
        "device": _int(values["device"], "device", minimum=0),
        "batch": _int(values["batch"], "batch", minimum=1),
        "params": _params(values["params"], "params"),
        "inputs": _tensors(values["inputs"], "inputs"),
        "timeout_ms": _optional_int(values["timeout_ms"], "timeout_ms", minimum=1),
    }


def _validated(cls: type[T], values: dict[str, Any]) -> T:
    """An instance of frozen message class ``cls`` from values already validated as its
    ``__post_init__`` would (a wire body is validated once, not twice)."""
    msg = object.__new__(cls)
    msg.__dict__.update(values)
    return msg


def _patch_fields_of(r: _Body) -> dict[str, Any]:
    """The shared fields read from a wire body."""
    return {
        "program": r.required("program"),
        "device": r.required("device"),
        "batch": r.batch(),
        "params": r.required("params"),
        "inputs": r.optional("inputs", {}),
        "timeout_ms": r.optional("timeout_ms", None),
    }


@dataclass(frozen=True)
class StepRequestMsg(_Message):
    """``step``: patch ``program``'s graph on ``device`` with ``params``, replay it, return outputs.

    ``batch`` may be omitted on the wire; it is then ``len(params.actual_seq_lengths_kv)``.
    ``inputs`` are copied into the graph's static buffers; ``outputs`` names the
    tensors to send back (at most 16). ``timeout_ms`` bounds the whole step.
    """

    OP: ClassVar[str] = "step"
    program: str
    device: int
    batch: int
    params: dict[str, Any]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: tuple[str, ...] = ("out",)
    timeout_ms: int | None = None

    def __post_init__(self) -> None:
        _set(self, outputs=_names(self.outputs, "outputs"), **_checked_patch_fields(vars(self)))

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        fast = _step_fields(body)  # a plain, valid step body: the common case, checked flat
        if fast is not None:
            return _validated(cls, fast)
        r = _Body(cls, body)
        values = _checked_patch_fields(_patch_fields_of(r))
        values["outputs"] = _names(r.optional("outputs", ("out",)), "outputs")
        return _validated(cls, values)


_STEP_FIELDS = frozenset(
    {"program", "device", "batch", "params", "inputs", "outputs", "timeout_ms"}
)


def _step_fields(body: Any) -> dict[str, Any] | None:
    """A step body's validated fields, when the body is a decoded map of exact types
    that passes every check of the full path (from_body's _Body, _checked_patch_fields
    and _names) and needs no conversion; None otherwise, and the full path then gives
    the same fields or names the bad one. Flat: a step is the request that comes by
    the thousand."""
    if type(body) is not dict or not body.keys() <= _STEP_FIELDS:
        return None
    program = body.get("program")
    device = body.get("device")
    params = body.get("params")
    if not (
        type(program) is str
        and program
        and type(device) is int
        and device >= 0
        and type(params) is dict
    ):
        return None
    for key in params:
        if type(key) is not str:
            return None
    if "batch" in body:
        batch = body["batch"]
        if type(batch) is not int or batch < 1:
            return None
    else:
        lengths = params.get(BATCH_PARAM)
        if type(lengths) is not list:
            return None
        batch = len(lengths)
        if batch < 1:
            return None
    inputs = body.get("inputs", {})
    if type(inputs) is not dict:
        return None
    for key, item in inputs.items():
        if type(key) is not str or not isinstance(item, torch.Tensor):
            return None
    timeout_ms = body.get("timeout_ms")
    if timeout_ms is not None and (type(timeout_ms) is not int or timeout_ms < 1):
        return None
    outputs = body.get("outputs", ("out",))
    if type(outputs) is not list and type(outputs) is not tuple:
        return None
    if len(outputs) > MAX_OUTPUTS:
        return None
    for name in outputs:
        if type(name) is not str or not name:
            return None
    if len(outputs) > 1 and len(set(outputs)) != len(outputs):
        return None
    return {
        "program": program,
        "device": device,
        "batch": batch,
        "params": dict(params),
        "inputs": dict(inputs),
        "timeout_ms": timeout_ms,
        "outputs": tuple(outputs),
    }


@dataclass(frozen=True)
class UpdateRequestMsg(_Message):
    """``update``: patch the graph for the next replay, without replaying it.

    Fields as ``step`` without ``outputs``; ``batch`` is inferred the same way.
    """

    OP: ClassVar[str] = "update"
    program: str
    device: int
    batch: int
    params: dict[str, Any]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    timeout_ms: int | None = None

    def __post_init__(self) -> None:
        _set(self, **_checked_patch_fields(vars(self)))

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        return _validated(cls, _checked_patch_fields(_patch_fields_of(_Body(cls, body))))


@dataclass(frozen=True)
class ReplayRequestMsg(_Message):
    """``replay``: replay the graph as last patched, return ``outputs``. ``batch`` is required."""

    OP: ClassVar[str] = "replay"
    program: str
    device: int
    batch: int
    outputs: tuple[str, ...] = ("out",)
    timeout_ms: int | None = None

    def __post_init__(self) -> None:
        _set(
            self,
            program=_str(self.program, "program", non_empty=True),
            device=_int(self.device, "device", minimum=0),
            batch=_int(self.batch, "batch", minimum=1),
            outputs=_names(self.outputs, "outputs"),
            timeout_ms=_optional_int(self.timeout_ms, "timeout_ms", minimum=1),
        )

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Body(cls, body)
        return cls(
            program=r.required("program"),
            device=r.required("device"),
            batch=r.required("batch"),
            outputs=r.optional("outputs", ("out",)),
            timeout_ms=r.optional("timeout_ms", None),
        )


@dataclass(frozen=True)
class DrainRequest(_Message):
    """``drain``: finish in-flight work and take no more, on one device or (no ``device``) all."""

    OP: ClassVar[str] = "drain"
    device: int | None = None

    def __post_init__(self) -> None:
        _optional_int(self.device, "device", minimum=0)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        r = _Body(cls, body)
        return cls(device=r.optional("device", None))


@dataclass(frozen=True)
class ShutdownRequest(_Message):
    """``shutdown``: drain, stop the workers, exit. Body: ``{}``."""

    OP: ClassVar[str] = "shutdown"

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        _Body(cls, body)
        return cls()


Message: TypeAlias = (
    Hello
    | StatusRequest
    | StepRequestMsg
    | UpdateRequestMsg
    | ReplayRequestMsg
    | DrainRequest
    | ShutdownRequest
)

MESSAGES: dict[str, type[Message]] = {
    cls.OP: cls
    for cls in (
        Hello,
        StatusRequest,
        StepRequestMsg,
        UpdateRequestMsg,
        ReplayRequestMsg,
        DrainRequest,
        ShutdownRequest,
    )
}
"""Operation name → body class."""


def parse_body(op: str, body: Mapping[str, Any]) -> Message:
    """The typed body of a decoded request; raises ``BadRequest`` naming ``op`` or the field."""
    cls = MESSAGES.get(op) if isinstance(op, str) else None
    if cls is None:
        raise BadRequest(f"op: unknown operation {op!r} (known: {sorted(MESSAGES)})")
    return cls.from_body(body)


def encode_message(request_id: int, message: Message) -> list[bytes | memoryview]:
    """Frames of a request carrying ``message`` (``encode_request`` with its op and body)."""
    return encode_request(request_id, message.OP, message.to_body())
