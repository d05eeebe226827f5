"""The served model in transformers, for checking the tokens a ``model`` program gives:
:func:`reference_model` builds it from the program's ``hello`` entry (seeded random
weights, or the model directory when it is on this machine) and :func:`greedy` gives
its greedy tokens. The scheduler that the load test and the demo run is the client's
(:mod:`graphlane.client.scheduler`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch


def reference_model(described: Mapping[str, Any]) -> Any:
    """The served model in transformers, from the program's hello ``config``: seeded
    random weights (``random``, ``seed``, ``init_std``) or its model directory (when it
    exists on this machine), in the served dtype. ValueError says why it cannot be
    built (transformers missing, a directory elsewhere)."""
    from graphlane.hf_model import ModelSpec, random_weights

    check_reference(described)
    import transformers

    cfg = described.get("config", described)
    dtype = getattr(torch, str(cfg.get("dtype") or "float32"))
    if cfg.get("model"):
        path = Path(str(cfg["model"]))
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        raw = dict(cfg.get("random") or {})
        spec = ModelSpec.from_hf(raw, "random")
        names = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[spec.model_type]
        keys = {k: v for k, v in raw.items() if k != "model_type"}
        hf_config = getattr(transformers, f"{names}Config")(
            **keys, bos_token_id=None, eos_token_id=None, pad_token_id=None
        )
        model = getattr(transformers, f"{names}ForCausalLM")(hf_config)
        model.load_state_dict(random_weights(spec, int(cfg["seed"]), float(cfg["init_std"]),
                                             torch.float32))  # fmt: skip
        model = model.to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def check_reference(described: Mapping[str, Any]) -> None:
    """ValueError saying why :func:`reference_model` cannot build the model here."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError(
            "checking tokens needs transformers (pip install 'graphlane[test]')"
        ) from None
    cfg = described.get("config", described)
    if cfg.get("model"):
        path = Path(str(cfg["model"]))
        if not (path / "config.json").is_file():
            raise ValueError(f"the model directory {path} is not on this machine")
    elif not cfg.get("random") or "init_std" not in cfg:
        raise ValueError("the daemon's hello does not describe its random weights")


def greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    """transformers' eager greedy ``generate``: the ``new`` tokens after ``prompt``."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)  # fmt: skip
    return [int(t) for t in out[0, len(prompt) :]]


__all__ = ["check_reference", "greedy", "reference_model"]
