"""A Llama-family model as the ``model`` program serves it: its architecture (read from a
Hugging Face ``config.json``) and its weights (safetensors, or seeded random ones).

Supported: ``model_type`` ``llama`` (Llama 2 and 3: GQA, ``rope_theta``, the ``llama3``
and ``linear`` rope scalings, ``attention_bias``, ``mlp_bias``), ``qwen2`` (Qwen2 and
Qwen2.5: bias on q/k/v) and ``mistral``, a sliding window only where no sequence the
program serves is longer than it; tied or untied embeddings. A key config.json lacks is
read with transformers' default for that architecture (:data:`DEFAULTS`), as
transformers would build the model. Everything else is refused naming the key
(docs/models.md says why: MoE, MLA, multimodal towers are other graphs).

Both rope config spellings are read: transformers 5's ``rope_parameters`` (with
``rope_theta`` inside) and transformers 4's ``rope_theta`` + ``rope_scaling``.

Nothing here touches a device: :func:`load_weights` returns host tensors by their
Hugging Face names (``model.layers.0.self_attn.q_proj.weight``, ...).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from graphlane.program_config import ProgramConfigError

ARCHITECTURES = ("llama", "qwen2", "mistral")
ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "swish")  # one function in transformers' ACT2FN

# What a key absent from config.json means: transformers' own default for it (its
# LlamaConfig, Qwen2Config and MistralConfig, transformers 5), for every key those
# models' math reads. None: derived (head_dim from hidden_size / num_attention_heads,
# num_key_value_heads from num_attention_heads), as transformers derives it.
_COMMON: dict[str, Any] = {
    "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "head_dim": None, "rope_theta": 10000.0,
}  # fmt: skip
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _COMMON | {
        "vocab_size": 32000, "intermediate_size": 11008, "num_key_value_heads": None,
        "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False,
    },
    "qwen2": _COMMON | {
        "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
        "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28, "layer_types": None,
    },
    "mistral": _COMMON | {
        "vocab_size": 32000, "intermediate_size": 14336, "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32, "sliding_window": 4096,
    },
}  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    """The architecture of a Llama-family decoder, as its config.json gives it (every
    key transformers' math reads, with transformers' default where the file has none)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str | None = None
    # The attention window of a layer that has one (None: every layer attends to the
    # whole sequence), and the config.json key that sets it, for the refusal that names
    # it when sequences can be longer than the window (ModelConfig.validated).
    sliding_window: int | None = None
    window_key: str | None = None
    window_default: bool = False  # the window is transformers' default (key absent)

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], where: str) -> ModelSpec:
        """The spec of a config.json mapping, each key absent read as transformers
        reads it (:data:`DEFAULTS`); ProgramConfigError naming the key otherwise."""
        mt = raw.get("model_type")
        if mt not in ARCHITECTURES:
            raise ProgramConfigError(
                f"{where}.model_type",
                f"{mt!r} is not served (served: {list(ARCHITECTURES)}; see docs/models.md)",
            )
        defaults = DEFAULTS[mt]

        def get(key: str, kind: str = "int") -> Any:
            v = raw[key] if key in raw else defaults[key]
            if kind == "int" and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ProgramConfigError(f"{where}.{key}", f"must be a positive integer, not {v!r}")
            if kind == "float" and (
                isinstance(v, bool) or not isinstance(v, int | float) or not v > 0
            ):
                raise ProgramConfigError(f"{where}.{key}", f"must be a positive number, not {v!r}")
            if kind == "bool" and not isinstance(v, bool):
                raise ProgramConfigError(f"{where}.{key}", f"must be true or false, not {v!r}")
            return v

        if get("hidden_act", "str") not in ACTIVATIONS:
            raise ProgramConfigError(
                f"{where}.hidden_act", f"{raw.get('hidden_act')!r}: only 'silu' is served"
            )
        for key in ("num_experts", "num_local_experts", "kv_lora_rank"):
            if raw.get(key):
                raise ProgramConfigError(f"{where}.{key}", "MoE and MLA models are not served")
        heads, hidden = get("num_attention_heads"), get("hidden_size")
        kv_heads = raw.get("num_key_value_heads", defaults["num_key_value_heads"]) or heads
        if (
            not isinstance(kv_heads, int)
            or isinstance(kv_heads, bool)
            or kv_heads < 1
            or (heads % kv_heads)
        ):
            raise ProgramConfigError(
                f"{where}.num_key_value_heads",
                f"{kv_heads!r}"
                f"{'' if 'num_key_value_heads' in raw else f' (transformers default for {mt})'}"
                f" must divide num_attention_heads {heads}",
            )
        head_dim = raw.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
            raise ProgramConfigError(
                f"{where}.head_dim", f"must be a positive integer, not {head_dim!r}"
            )
        max_pos = get("max_position_embeddings")
        rope = _rope(raw, defaults, max_pos, where)
        window, window_key = _window(raw, mt, get("num_hidden_layers"), where)
        attention_bias = mt == "llama" and get("attention_bias", "bool")
        return cls(
            model_type=mt,
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps", "float")),
            max_position_embeddings=max_pos,
            tie_word_embeddings=get("tie_word_embeddings", "bool"),
            qkv_bias=mt == "qwen2" or attention_bias,  # qwen2: q/k/v always, o never
            o_bias=attention_bias,
            mlp_bias=mt == "llama" and get("mlp_bias", "bool"),  # the others have none
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            sliding_window=window,
            window_key=window_key,
            window_default=window is not None and "sliding_window" not in raw,
            **rope,
        )

    # ------------------------------------------------------------ rotary embedding
    def inv_freq(self) -> torch.Tensor:
        """float32 [head_dim / 2]: computed as transformers computes it (same operations
        in the same order, so the tables agree bit for bit)."""
        dim = self.head_dim
        inv = 1.0 / (
            self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
        )
        if self.rope_type == "linear":
            return inv / self.rope_factor
        if self.rope_type != "llama3":
            return inv
        factor, low, high = self.rope_factor, self.low_freq_factor, self.high_freq_factor
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def rope_tables(self, positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [positions, head_dim] in ``dtype`` (host tensors)."""
        pos = torch.arange(positions, dtype=torch.int64).float()
        freqs = pos[:, None] * self.inv_freq()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    # ------------------------------------------------------------ weights
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model reads, by its Hugging Face name."""
        h, n, kv, d = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        inter = self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (n * d, h),
                p + "self_attn.k_proj.weight": (kv * d, h),
                p + "self_attn.v_proj.weight": (kv * d, h),
                p + "self_attn.o_proj.weight": (h, n * d),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
            if self.qkv_bias:
                shapes |= {
                    p + "self_attn.q_proj.bias": (n * d,),
                    p + "self_attn.k_proj.bias": (kv * d,),
                    p + "self_attn.v_proj.bias": (kv * d,),
                }
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if self.mlp_bias:
                shapes |= {
                    p + "mlp.gate_proj.bias": (inter,),
                    p + "mlp.up_proj.bias": (inter,),
                    p + "mlp.down_proj.bias": (h,),
                }
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


def _rope(
    raw: Mapping[str, Any], defaults: Mapping[str, Any], max_pos: int, where: str
) -> dict[str, Any]:
    """The rotary embedding's fields of a config.json, as transformers standardises them:
    ``rope_scaling`` (transformers 4) before ``rope_parameters`` (5), ``rope_theta`` from
    that table, else the top level, else 10000; a scaling's own keys required."""
    name = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    table = raw.get(name) or {}
    if not isinstance(table, Mapping):
        raise ProgramConfigError(f"{where}.{name}", f"must be a table, not {table!r}")
    rope = dict(table)
    theta = rope.get("rope_theta", raw.get("rope_theta", defaults["rope_theta"]))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise ProgramConfigError(f"{where}.rope_theta", f"must be a positive number, not {theta!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ProgramConfigError(
            f"{where}.{name}.rope_type",
            f"{rope_type!r} is not served (served: {list(ROPE_TYPES)})",
        )
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        key = f"{name}.partial_rotary_factor" if "partial_rotary_factor" in rope else (
            "partial_rotary_factor")  # fmt: skip
        raise ProgramConfigError(f"{where}.{key}", f"{partial!r}: only 1.0 is served")
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    needs = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor")}[rope_type]  # fmt: skip
    for key in needs:
        v = rope.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            raise ProgramConfigError(
                f"{where}.{name}.{key}", f"a {rope_type} rope needs a positive number, not {v!r}"
            )
    if rope_type != "default":
        out["rope_factor"] = float(rope["factor"])
    if rope_type == "llama3":
        out["low_freq_factor"] = float(rope["low_freq_factor"])
        out["high_freq_factor"] = float(rope["high_freq_factor"])
        # transformers: a top-level original_max_position_embeddings wins, then the
        # table's, then max_position_embeddings
        old = raw.get("original_max_position_embeddings") or rope.get(
            "original_max_position_embeddings", max_pos
        )
        if isinstance(old, bool) or not isinstance(old, int) or old < 1:
            raise ProgramConfigError(
                f"{where}.{name}.original_max_position_embeddings",
                f"must be a positive integer, not {old!r}",
            )
        out["original_max_position_embeddings"] = old
    return out


def _window(
    raw: Mapping[str, Any], mt: str, layers: int, where: str
) -> tuple[int | None, str | None]:
    """The sliding window transformers applies (None: none), and the key that sets it.
    Mistral: ``sliding_window`` on every layer (4096 when absent; null turns it off).
    Qwen2: only with ``use_sliding_window``, on the layers ``layer_types`` (or
    ``max_window_layers``) make sliding."""
    defaults = DEFAULTS[mt]
    if mt == "llama":
        return None, None
    window = raw.get("sliding_window", defaults["sliding_window"])
    key = "sliding_window"
    if mt == "qwen2":
        if not raw.get("use_sliding_window", False) or window is None:
            return None, None
        types = raw.get("layer_types")
        if types is None:
            first = raw.get("max_window_layers", defaults["max_window_layers"])
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        if "sliding_attention" not in list(types):
            return None, None
        key = "use_sliding_window"
    if window is None:
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ProgramConfigError(
            f"{where}.sliding_window", f"must be a positive integer, not {window!r}"
        )
    return window, key


def read_hf_config(directory: str, where: str) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProgramConfigError(f"{where}.model", f"{path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ProgramConfigError(f"{where}.model", f"{path} cannot be read: {exc}") from exc
    if not isinstance(raw, dict):
        raise ProgramConfigError(f"{where}.model", f"{path} is not a JSON object")
    return raw


def safetensors_files(directory: str, where: str) -> list[Path]:
    """The checkpoint's files: those ``model.safetensors.index.json`` names, else
    ``model.safetensors``, else every ``*.safetensors`` of the directory."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ProgramConfigError(f"{where}.model", f"{index} cannot be read: {exc}") from exc
        files = [d / f for f in sorted(set(weight_map.values()))]
    elif (d / "model.safetensors").exists():
        files = [d / "model.safetensors"]
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ProgramConfigError(f"{where}.model", f"{d} has no safetensors weights")
    for f in files:
        if not f.exists():
            raise ProgramConfigError(f"{where}.model", f"{f} (named by the index) is missing")
    return files


def load_weights(
    spec: ModelSpec, directory: str, dtype: torch.dtype, where: str
) -> dict[str, torch.Tensor]:
    """The model's tensors from its safetensors files, in ``dtype``, checked against
    :meth:`ModelSpec.weight_shapes` (a missing or misshapen tensor is refused by name)."""
    from safetensors import safe_open

    shapes = spec.weight_shapes()
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(directory, where):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (a safe_open has no __iter__)
                if name in shapes:
                    out[name] = st.get_tensor(name).to(dtype)
    for name, shape in shapes.items():
        t = out.get(name)
        if t is None:
            raise ProgramConfigError(f"{where}.model", f"the checkpoint has no tensor {name}")
        if tuple(t.shape) != shape:
            raise ProgramConfigError(
                f"{where}.model", f"{name} has shape {list(t.shape)}, the config says {list(shape)}"
            )
    return out


def random_weights(
    spec: ModelSpec, seed: int, std: float, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Seeded random weights by Hugging Face name (a normal of ``std`` for matrices and
    biases, 1 plus a normal of ``std`` for norms): the same seed gives the same model on
    every machine, so a test or the demo can load them into transformers too."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in spec.weight_shapes().items():
        t = torch.randn(shape, generator=g, dtype=torch.float32) * std
        if name.endswith("norm.weight"):
            t += 1.0
        out[name] = t.to(dtype)
    return out
