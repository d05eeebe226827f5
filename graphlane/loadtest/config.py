"""The configuration of ``graphlane loadtest``: :class:`LoadConfig`, one for every program,
checked where it is made (the settings one shape of load does not read are refused by
:mod:`.driver`)."""

from __future__ import annotations

import math
import random
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
        """The shape ``raw`` (keys of :data:`SHAPE_KEYS`) gives over the defaults;
        ValueError naming the key."""
        known = [f.name for f in fields(cls)]
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
    """One load test; each field is a flag of ``graphlane loadtest`` (see its ``--help``).
    ``verify`` None: :data:`VERIFY` by the shape of load; ``max_outstanding`` None: 10 s
    of arrivals, clamped to 100..10,000. Invalid values raise ValueError naming the flag.
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
        def need(ok: object, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.endpoint, "--connect must name an endpoint (tcp://HOST:PORT or ipc://PATH)")
        need((self.concurrency is None) != (self.rate is None),
             "give exactly one of --concurrency (closed loop) or --rate (open loop)")
        need(self.concurrency is None or _at_least(self.concurrency, 1),
             f"--concurrency must be an integer >= 1, not {self.concurrency!r}")
        need(self.rate is None or (isinstance(self.rate, (int, float))
                                   and not isinstance(self.rate, bool) and self.rate > 0),
             f"--rate must be > 0 (steps per second), not {self.rate!r}")  # fmt: skip
        need(self.rate != math.inf or self.num_prompts is not None,
             "--rate inf (every request at once) needs --num-prompts N")
        need(self.num_prompts is None or _at_least(self.num_prompts, 1),
             f"--num-prompts must be an integer >= 1, not {self.num_prompts!r}")
        for flag, v, hi in (("--duration", self.duration_s, math.inf),
                            ("--timeout", self.timeout_s, math.inf)):  # fmt: skip
            need(_is_real(v) and 0 < v < hi, f"{flag} must be > 0 seconds, not {v!r}")
        need(self.verify is None or _fraction(self.verify),
             f"--verify must be a fraction in [0, 1], not {self.verify!r}")
        need(_fraction(self.max_unavailable),
             f"--max-unavailable must be a fraction in [0, 1], not {self.max_unavailable!r}")
        need((self.server_key is None) == (self.client_key is None),
             key_flags_problem(self.server_key, self.client_key) or "")
        need(isinstance(self.program, str) and self.program, "--program must name a program")
        need(_is_int(self.seed), f"--seed must be an integer, not {self.seed!r}")
        if self.devices is not None:
            need(self.devices, "--devices must list at least one device")
            need(all(_at_least(d, 0) for d in self.devices),
                 f"--devices must be device ids >= 0, not {list(self.devices)}")
            need(len(set(self.devices)) == len(self.devices),
                 f"--devices lists a device twice: {list(self.devices)}")
        if self.batch_sizes is not None:
            need(self.batch_sizes, "--batch-sizes must list at least one batch size")
            need(all(_at_least(b, 1) for b in self.batch_sizes),
                 f"--batch-sizes must be >= 1, not {list(self.batch_sizes)}")
        need(self.max_outstanding is None or _at_least(self.max_outstanding, 1),
             f"--max-outstanding must be >= 1, not {self.max_outstanding!r}")
        for flag, pair in (("--prompt-lens", self.prompt_lens),
                           ("--decode-tokens", self.decode_tokens)):  # fmt: skip
            need(pair is None or (len(pair) == 2 and all(_is_int(v) for v in pair)
                                  and 1 <= pair[0] <= pair[1]),
                 f"{flag} takes two integers LO,HI with 1 <= LO <= HI")  # fmt: skip
        unknown = sorted(set(self.shape) - set(SHAPE_KEYS))
        need(not unknown, f"--shape: unknown key(s) {unknown} (known: {', '.join(SHAPE_KEYS)})")
        AttentionShape.from_mapping(dict(self.shape), "--shape")

    def draw_lengths(self, rng: random.Random, longest: int) -> tuple[int, int]:
        """A prompt length in ``prompt_lens`` (default 1..half ``longest``) and tokens to
        decode in ``decode_tokens``, cut to fit a sequence of ``longest`` tokens."""
        lo, hi = self.prompt_lens or (1, max(1, longest // 2))
        new = rng.randint(*(self.decode_tokens or DECODE_TOKENS))
        prompt = max(1, min(rng.randint(lo, hi), longest - new))
        return prompt, max(1, min(new, longest - prompt))

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


def _fraction(v: object) -> bool:
    return _is_real(v) and 0.0 <= v <= 1.0  # type: ignore[operator]


def _at_least(v: object, low: int) -> bool:
    return _is_int(v) and v >= low  # type: ignore[operator]


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
