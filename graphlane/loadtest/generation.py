"""The served model in transformers, for checking a ``model`` program's tokens (the load
test's and the demo's): :func:`reference_model` builds it from the program's ``hello``
entry, :class:`Judge` says whether served tokens are its greedy ones (exactly, or up to
a near tie of a half-precision dtype: docs/models.md, "Precision")."""

from __future__ import annotations

import copy
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
            **keys, bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip
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
        raise ValueError("checking tokens needs transformers (pip install "
                         "'graphlane[test]')") from None  # fmt: skip
    cfg = described.get("config", described)
    if cfg.get("model"):
        path = Path(str(cfg["model"]))
        if not (path / "config.json").is_file():
            raise ValueError(f"the model directory {path} is not on this machine")
    elif not cfg.get("random") or "init_std" not in cfg:
        raise ValueError("the daemon's hello does not describe its random weights")


def tie_allowance(dtype: torch.dtype) -> float:
    """How close transformers' own logits of two tokens must be, relative to the logit
    scale (the largest magnitude), for either to be a right greedy pick: 8 roundings of
    the dtype (bfloat16: ``8 * 2**-8``, docs/models.md, "Precision"; float16: ``8 * 2**-11``);
    float32 is checked exactly (0)."""
    if dtype == torch.float32 or not dtype.is_floating_point:
        return 0.0
    return 8 * torch.finfo(dtype).eps / 2


#: What :func:`judge` finds of a request's tokens.
EXACT, TIE, DIFFER = "exact", "tie", "differ"


class Judge:
    """Served tokens against transformers' greedy ones from the same prompt
    (docs/models.md, "Precision"): equal (:data:`EXACT`); or, at the first token that
    differs, transformers' own logits of its token and ours are within
    :func:`tie_allowance` of each other, or ours is the token float32 arithmetic picks
    from the same context (:data:`TIE`: a rounding decided it; the tokens after it are
    not compared, their contexts differ); else :data:`DIFFER`."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self.allowance = tie_allowance(self.dtype)
        self._exact: Any = None

    def exact(self) -> Any:
        """The model in float32 (made once, when a difference asks for it)."""
        if self._exact is None:
            self._exact = copy.deepcopy(self.model).float()
        return self._exact

    def __call__(self, prompt: list[int], ours: list[int]) -> tuple[str, int | None]:
        """:data:`EXACT`, :data:`TIE` or :data:`DIFFER`, and the first position where
        the tokens differ (None when equal)."""
        with torch.no_grad():
            ref = self.model.generate(
                torch.tensor([prompt]), max_new_tokens=len(ours), min_new_tokens=len(ours),
                do_sample=False, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        theirs = [int(t) for t in ref.sequences[0, len(prompt) :]]
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b),
                     None)  # fmt: skip
        if first is None:
            return EXACT, None
        if self.allowance == 0.0:
            return DIFFER, first
        logits = ref.logits[first][0].float()
        scale = float(logits.abs().max())
        gap = float(logits[theirs[first]] - logits[ours[first]])
        if 0.0 <= gap <= self.allowance * scale:
            return TIE, first
        with torch.no_grad():
            context = torch.tensor([prompt + theirs[:first]])
            exact = self.exact()(context).logits[0, -1]
        return (TIE if int(exact.argmax()) == ours[first] else DIFFER), first


__all__ = ["DIFFER", "EXACT", "TIE", "Judge", "check_reference", "reference_model",
           "tie_allowance"]
