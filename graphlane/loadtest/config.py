"""The configuration of ``graphlane loadtest``: :class:`LoadConfig`, checked where it is
made. One config for every program; the settings that only one shape of load reads
(``batch_sizes`` and ``shape`` for independent calls, ``prompt_lens`` and
``decode_tokens`` for sequences) are refused by :mod:`.driver` for the other.

See :mod:`graphlane.loadtest`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from graphlane.cli_support import key_flags_problem

from .availability import MAX_UNAVAILABLE

_SHAPE_DTYPES = ("float16", "bfloat16", "float32")  # the program's dtypes
#: Keys of ``--shape`` / ``LoadConfig.shape`` (defaults from AttentionShape).
SHAPE_KEYS = ("layers", "num_heads", "num_kv_heads", "head_dim", "max_kv_len", "dtype")


@dataclass(frozen=True)
class AttentionShape:
    """The attention program's shape as the load test reads it: the keys and defaults
    of the program's config (``AttentionShape``, which the worker reads: this process
    imports nothing of the workers; tests/test_layout.py holds the two equal)."""

    layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    max_kv_len: int = 256
    buckets: tuple[int, ...] = (1, 2, 4, 8)
    dtype: str = "float16"

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], where: str = "--shape") -> AttentionShape:
        """The shape ``raw`` gives over the defaults; ValueError naming the key."""
        known = [f.name for f in fields(cls)]
        for key in raw:
            if key not in known:
                raise ValueError(f"{where}.{key}: unknown key (known: {', '.join(known)})")
        shape = cls(**{**raw, "buckets": tuple(raw.get("buckets", cls.buckets))})
        for key in known[:5]:
            v = getattr(shape, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{where}.{key}: must be a positive integer, not {v!r}")
        if shape.num_heads % shape.num_kv_heads:
            raise ValueError(f"{where}.num_kv_heads: {shape.num_kv_heads} must divide "
                             f"num_heads {shape.num_heads}")  # fmt: skip
        if shape.dtype not in _SHAPE_DTYPES:
            raise ValueError(f"{where}.dtype: must be one of {sorted(_SHAPE_DTYPES)}")
        return shape

#: Tokens each sequence decodes when ``decode_tokens`` is not given.
DECODE_TOKENS = (4, 32)
#: The checked share of steps when ``verify`` is not given: independent calls carry
#: their own key/value when checked, which costs bandwidth; a sequence's step is checked
#: from the host copy of its state at no cost on the wire.
VERIFY = {"calls": 0.0, "sequences": 0.2}


@dataclass(frozen=True)
class LoadConfig:
    """One load test. Exactly one of ``concurrency`` (closed loop) and ``rate`` (open loop):
    calls in flight and call arrivals/s for a stateless program, live sequences and
    sequence arrivals/s for one with device state.

    ``verify``: the share of steps checked (None: :data:`VERIFY` by the shape of load).
    ``shape`` overrides AttentionShape's defaults for the keys in :data:`SHAPE_KEYS`
    where the daemon's ``hello`` does not describe them. ``max_outstanding`` caps the
    open loop's calls in flight (None: 10 s worth of arrivals, clamped to 100..10,000).
    ``prompt_lens`` (None: 1..half the longest sequence) and ``decode_tokens`` (None:
    :data:`DECODE_TOKENS`) are the ranges a sequence's lengths are drawn from (for a
    model program: its prompt and its output tokens). ``num_prompts`` (a model program
    only): requests to send, the run ending when they are answered; with it, ``rate``
    may be ``inf`` (every request at once). Invalid values raise ValueError naming the
    command-line flag.
    """

    endpoint: str
    duration_s: float
    concurrency: int | None = None
    rate: float | None = None
    program: str = "attention"
    devices: tuple[int, ...] | None = None
    batch_sizes: tuple[int, ...] | None = None
    verify: float | None = None
    report_dir: str | None = None
    seed: int = 0
    timeout_s: float = 30.0
    progress: bool = True
    shape: Mapping[str, Any] = field(default_factory=dict)
    max_outstanding: int | None = None
    max_unavailable: float = MAX_UNAVAILABLE
    server_key: str | None = None  # CurveZMQ: the daemon's server.key
    client_key: str | None = None  # CurveZMQ: this client's NAME.key_secret
    prompt_lens: tuple[int, int] | None = None
    decode_tokens: tuple[int, int] | None = None
    num_prompts: int | None = None  # a model program: requests to send (then the run ends)

    def __post_init__(self) -> None:
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))
        for name in ("batch_sizes", "prompt_lens", "decode_tokens"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "shape", MappingProxyType(dict(self.shape or {})))
        self.validate()

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    def validate(self) -> None:
        if not self.endpoint:
            raise ValueError("--connect must name an endpoint (tcp://HOST:PORT or ipc://PATH)")
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError(
                "give exactly one of --concurrency (closed loop) or --rate (open loop)"
            )
        if self.concurrency is not None and (not _is_int(self.concurrency) or self.concurrency < 1):
            raise ValueError(f"--concurrency must be an integer >= 1, not {self.concurrency!r}")
        if self.rate is not None and not (
            isinstance(self.rate, (int, float)) and not isinstance(self.rate, bool)
            and 0 < self.rate <= math.inf
        ):  # fmt: skip
            raise ValueError(f"--rate must be > 0 (steps per second), not {self.rate!r}")
        if self.rate == math.inf and self.num_prompts is None:
            raise ValueError("--rate inf (every request at once) needs --num-prompts N")
        if self.num_prompts is not None and (not _is_int(self.num_prompts) or self.num_prompts < 1):
            raise ValueError(f"--num-prompts must be an integer >= 1, not {self.num_prompts!r}")
        if not (_is_real(self.duration_s) and 0 < self.duration_s < math.inf):
            raise ValueError(f"--duration must be > 0 seconds, not {self.duration_s!r}")
        if not (_is_real(self.timeout_s) and 0 < self.timeout_s < math.inf):
            raise ValueError(f"--timeout must be > 0 seconds, not {self.timeout_s!r}")
        if self.verify is not None and not (_is_real(self.verify) and 0.0 <= self.verify <= 1.0):
            raise ValueError(f"--verify must be a fraction in [0, 1], not {self.verify!r}")
        if not (_is_real(self.max_unavailable) and 0.0 <= self.max_unavailable <= 1.0):
            raise ValueError(
                f"--max-unavailable must be a fraction in [0, 1], not {self.max_unavailable!r}"
            )
        if (self.server_key is None) != (self.client_key is None):
            raise ValueError(key_flags_problem(self.server_key, self.client_key))
        if not isinstance(self.program, str) or not self.program:
            raise ValueError("--program must name a program")
        if not _is_int(self.seed):
            raise ValueError(f"--seed must be an integer, not {self.seed!r}")
        if self.devices is not None:
            if not self.devices:
                raise ValueError("--devices must list at least one device")
            if any(not _is_int(d) or d < 0 for d in self.devices):
                raise ValueError(f"--devices must be device ids >= 0, not {list(self.devices)}")
            if len(set(self.devices)) != len(self.devices):
                raise ValueError(f"--devices lists a device twice: {list(self.devices)}")
        if self.batch_sizes is not None:
            if not self.batch_sizes:
                raise ValueError("--batch-sizes must list at least one batch size")
            if any(not _is_int(b) or b < 1 for b in self.batch_sizes):
                raise ValueError(f"--batch-sizes must be >= 1, not {list(self.batch_sizes)}")
        if self.max_outstanding is not None and (
            not _is_int(self.max_outstanding) or self.max_outstanding < 1
        ):
            raise ValueError(f"--max-outstanding must be >= 1, not {self.max_outstanding!r}")
        for flag, pair in (("--prompt-lens", self.prompt_lens),
                           ("--decode-tokens", self.decode_tokens)):  # fmt: skip
            if pair is not None and not (
                len(pair) == 2 and all(_is_int(v) for v in pair) and 1 <= pair[0] <= pair[1]
            ):
                raise ValueError(f"{flag} takes two integers LO,HI with 1 <= LO <= HI")
        unknown = sorted(set(self.shape) - set(SHAPE_KEYS))
        if unknown:
            raise ValueError(f"--shape: unknown key(s) {unknown} (known: {', '.join(SHAPE_KEYS)})")
        try:
            AttentionShape.from_mapping(dict(self.shape), "--shape")
        except TypeError as exc:
            raise ValueError(f"--shape: {exc}") from None

    def verify_share(self, load: str) -> float:
        """The share of steps checked for ``load`` ("calls" or "sequences")."""
        return VERIFY[load] if self.verify is None else self.verify

    def outstanding_cap(self) -> int:
        if self.max_outstanding is not None:
            return self.max_outstanding
        return min(10_000, max(100, math.ceil(10 * (self.rate or 0.0))))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["devices"] = None if self.devices is None else list(self.devices)
        for name in ("batch_sizes", "prompt_lens", "decode_tokens"):
            value = getattr(self, name)
            out[name] = None if value is None else list(value)
        out["shape"] = dict(self.shape)
        out["mode"] = self.mode
        if self.rate == math.inf:
            out["rate"] = "inf"  # JSON has no infinity
        return out


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
