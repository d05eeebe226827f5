"""A Llama-family model as the ``model`` program serves it: its architecture (read from a
Hugging Face ``config.json``) and its weights (safetensors, or seeded random ones).

Supported: ``model_type`` ``llama`` (Llama 2 and 3: GQA, ``rope_theta``, the ``llama3``
and ``linear`` rope scalings, ``attention_bias``, ``mlp_bias``), ``qwen2`` (Qwen2 and
Qwen2.5: bias on q/k/v) and ``mistral`` without a sliding window; tied or untied
embeddings. Everything else is refused naming the key (docs/models.md says why: MoE,
MLA, sliding windows, multimodal towers are other graphs).

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

from .base import ProgramConfigError

ARCHITECTURES = ("llama", "qwen2", "mistral")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelSpec:
    """The architecture of a Llama-family decoder, as its config.json gives it."""

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

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], where: str) -> ModelSpec:
        """The spec of a config.json mapping; ProgramConfigError naming the key otherwise."""

        def get(key: str, default: Any = None, kind: type | tuple[type, ...] = int) -> Any:
            v = raw.get(key, default)
            if v is None and default is None:
                raise ProgramConfigError(f"{where}.{key}", "is required in the model's config")
            if kind is int and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ProgramConfigError(f"{where}.{key}", f"must be a positive integer, not {v!r}")
            if kind is float and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise ProgramConfigError(f"{where}.{key}", f"must be a number, not {v!r}")
            return v

        mt = raw.get("model_type")
        if mt not in ARCHITECTURES:
            raise ProgramConfigError(
                f"{where}.model_type",
                f"{mt!r} is not served (served: {list(ARCHITECTURES)}; see docs/models.md)",
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ProgramConfigError(f"{where}.hidden_act", "only 'silu' is served")
        if mt in ("qwen2", "mistral") and (
            raw.get("use_sliding_window") or (mt == "mistral" and raw.get("sliding_window"))
        ):
            raise ProgramConfigError(
                f"{where}.use_sliding_window", "sliding windows are not served"
            )
        for key in ("num_experts", "num_local_experts", "kv_lora_rank"):
            if raw.get(key):
                raise ProgramConfigError(f"{where}.{key}", "MoE and MLA models are not served")
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        head_dim = raw.get("head_dim") or hidden // heads
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ProgramConfigError(
                f"{where}.rope_parameters.rope_type",
                f"{rope_type!r} is not served (served: {list(ROPE_TYPES)})",
            )
        if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ProgramConfigError(f"{where}.partial_rotary_factor", "must be 1.0")
        max_pos = get("max_position_embeddings", 4096)
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=mt,
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6, float)),
            rope_theta=float(theta),
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings", max_pos)
            ),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or attention_bias,
            o_bias=mt != "qwen2" and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
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
