"""``torch.npu.amp`` of the simulated NPU: autocast's cast policy on the "npu" device and
torch_npu 2.14's ``GradScaler``.

Autocast. ``torch.autocast("npu")`` (and ``torch.npu.amp.autocast``) enables the
AutocastPrivateUse1 dispatch key; torch itself registers no kernel there, torch_npu
registers its policy in C++ (``torch_npu/csrc/aten/AutoCastOps.cpp``): matmuls,
convolutions and linear layers run in the autocast dtype (float16 unless given),
reductions, norms, losses and transcendental functions in float32, a few binary ops in
the widest input type, ``binary_cross_entropy`` refused. The sim registers the same
lists as Python kernels on that key (:func:`install`). One difference: torch's C++
autocast caches the lower-precision copy of a leaf parameter for the autocast region
(``cache_enabled``); the sim casts again at each use, which gives the same numbers.

GradScaler (``torch_npu/npu/amp/grad_scaler.py``). It is torch's ``GradScaler`` with the
NPU's own bookkeeping, which this class keeps because upstream's tests and the field's
training loops see it:

- ``unscale_`` checks the gradients with ``_amp_foreach_non_finite_check_and_unscale_``
  and reads ``found_inf`` on the host (``.item()``) to set ``_has_overflow``; ``step``
  skips the optimizer step on an overflow, ``update`` halves the scale on an overflow or
  counts a growth step (also host reads), not through ``_amp_update_scale_``. A
  ``step`` or ``update`` inside a capture is therefore a host read on a capturing
  stream, which the NPU (and the sim) refuse.
- An optimizer with ``_step_supports_amp_scaling`` (torch's fused Adam, AdamW, SGD,
  Adagrad) is stepped as ``optimizer.step(grad_scaler=self)``: torch 2.13/2.14's
  optimizers take no such argument, so this raises ``TypeError`` as on the NPU.
- ``state_dict`` carries ``"dynamic"``; ``is_support_inf_nan()`` is True (a 910B-class
  device in INF_NAN mode), so no float-status flags are cleared.
"""

from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler as _TorchGradScaler
from torch.amp.grad_scaler import OptState, _MultiDeviceReplicator, _refresh_per_optimizer_state

_AUTOCAST_KEY = getattr(torch._C.DispatchKey, "AutocastPrivateUse1")  # noqa: B009 (not in the stubs)

# torch_npu/csrc/aten/AutoCastOps.cpp, by cast policy (overloads as torch 2.13 names them;
# one torch 2.13 lacks is skipped).
LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "cudnn_convolution", "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell",
    "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
)  # fmt: skip
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "group_norm",
    "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp",
)  # fmt: skip
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
)  # fmt: skip
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put",
    "tensordot", "scatter_add",
)  # fmt: skip

_installed: list[torch.library.Library] = []


def _eligible(value: Any) -> bool:
    """at::autocast::is_autocast_eligible: a floating-point npu tensor other than float64."""
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.device.type == "npu"
        and value.dtype is not torch.float64
    )


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if _eligible(value):
        return value.to(dtype) if value.dtype is not dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for v in (*args, *kwargs.values()):
        out.extend(v if isinstance(v, (list, tuple)) else (v,))
    return out


def _kernel(op: torch._ops.OpOverload, policy: str) -> Any:
    dtype_pos = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def run(*args: Any, **kwargs: Any) -> Any:
        if policy == "lower_precision_fp":
            target = torch.get_autocast_dtype("npu")
            args, kwargs = _cast(args, target), {k: _cast(v, target) for k, v in kwargs.items()}
        elif policy == "fp32":
            args = _cast(args, torch.float32)
            kwargs = {k: _cast(v, torch.float32) for k, v in kwargs.items()}
        elif policy == "fp32_set_opt_dtype":
            # at::autocast set_opt_dtype: an eligible first argument and no dtype given
            # runs the op with dtype=float32 (the input itself is not cast).
            given = kwargs.get("dtype") is not None or (
                dtype_pos is not None and len(args) > dtype_pos and args[dtype_pos] is not None
            )
            if args and _eligible(args[0]) and not given:
                if dtype_pos is not None and len(args) > dtype_pos:
                    args = (*args[:dtype_pos], torch.float32, *args[dtype_pos + 1 :])
                else:
                    kwargs = {**kwargs, "dtype": torch.float32}
        else:  # promote: the widest eligible input type
            widest = torch.get_autocast_dtype("npu")
            for v in _leaves(args, kwargs):
                if _eligible(v):
                    widest = torch.promote_types(widest, v.dtype)
            args = _cast(args, widest)
            kwargs = {k: _cast(v, widest) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_AUTOCAST_KEY)):
            return op(*args, **kwargs)

    return run


def _binary_cross_entropy_banned(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
        "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
        "In this case, combine the two layers using "
        "torch.nn.functional.binary_cross_entropy_with_logits\n"
        "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits "
        "are safe to autocast."
    )


def install() -> None:
    """Register the autocast policy on AutocastPrivateUse1 (idempotent)."""
    if _installed:
        return
    # torch_npu registers the fallthrough too: ops of no list run as they are
    every = torch.library.Library("_", "IMPL")
    every.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    _installed.append(every)
    lib = torch.library.Library("aten", "IMPL")
    for policy, names in (
        ("lower_precision_fp", LOWER_PRECISION_FP),
        ("fp32", FP32),
        ("fp32_set_opt_dtype", FP32_SET_OPT_DTYPE),
        ("promote", PROMOTE),
    ):
        for name in names:
            base, _, overload = name.partition(".")
            packet = getattr(torch.ops.aten, base, None)
            op = getattr(packet, overload or "default", None) if packet is not None else None
            if op is None:
                continue
            lib.impl(name, _kernel(op, policy), "AutocastPrivateUse1")
    lib.impl("binary_cross_entropy", _binary_cross_entropy_banned, "AutocastPrivateUse1")
    _installed.append(lib)


# ------------------------------------------------------------------ torch.npu names


def get_amp_supported_dtype() -> list[torch.dtype]:
    """torch_npu ``npu/autocast_utils.py`` (bf16 is supported on a 910B-class device)."""
    return [torch.float16, torch.bfloat16, torch.float32]


def is_autocast_enabled() -> bool:
    return torch.is_autocast_enabled("npu")


def set_autocast_enabled(enable: bool) -> None:
    torch.set_autocast_enabled("npu", enable)


def get_autocast_dtype() -> torch.dtype:
    return torch.get_autocast_dtype("npu")


def set_autocast_dtype(dtype: torch.dtype) -> None:
    torch.set_autocast_dtype("npu", dtype)


class autocast(torch.amp.autocast_mode.autocast):
    """``torch.npu.amp.autocast(...)`` is ``torch.autocast("npu", ...)``, float16 by default."""

    def __init__(
        self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True
    ) -> None:
        super().__init__("npu", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


def custom_fwd(fwd: Any = None, *, cast_inputs: Any = None) -> Any:
    """Deprecated in torch_npu for ``torch.amp.custom_fwd(..., device_type="npu")``."""
    warnings.warn(
        "`torch_npu.npu.amp.custom_fwd(args...)` is deprecated. "
        "Please use `torch.amp.custom_fwd(args..., device_type='npu')` instead.",
        FutureWarning,
        stacklevel=2,
    )
    return functools.partial(torch.amp.custom_fwd, device_type="npu")(
        fwd=fwd, cast_inputs=cast_inputs
    )


def custom_bwd(bwd: Any) -> Any:
    """Deprecated in torch_npu for ``torch.amp.custom_bwd(..., device_type="npu")``."""
    warnings.warn(
        "`torch_npu.npu.amp.custom_bwd(args...)` is deprecated. "
        "Please use `torch.amp.custom_bwd(args..., device_type='npu')` instead.",
        FutureWarning,
        stacklevel=2,
    )
    return functools.partial(torch.amp.custom_bwd, device_type="npu")(bwd)


def is_support_inf_nan() -> bool:
    """``torch_npu.npu.utils.is_support_inf_nan``: a 910B-class device saturates to inf/nan."""
    return True


class GradScaler(_TorchGradScaler):
    """``torch_npu.npu.amp.GradScaler`` (see the module docstring for what differs from torch's)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        dynamic: bool = True,
        enabled: bool = True,
    ) -> None:
        super().__init__(
            "npu",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self._dynamic = dynamic
        self._has_overflow = False

    def _lazy_init_scale_growth_tracker(self, dev: Any) -> None:
        if self._growth_tracker is not None:
            raise RuntimeError("_growth_tracker initialized before _scale")
        scale = torch.full((), self._init_scale, dtype=torch.float32).pin_memory()
        self._scale = scale.to(dev, non_blocking=True)
        tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32).pin_memory()
        self._growth_tracker = tracker.to(dev, non_blocking=True)

    def scale(self, outputs: Any) -> Any:
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if outputs.device.type != "npu":
                raise ValueError("Device type of outputs should be npu.")
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            assert self._scale is not None
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)
        return super().scale(outputs)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        grads: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise TypeError("Attempting to unscale FP16 gradients.")
                    to_unscale = param.grad
                    if to_unscale.is_sparse:
                        if to_unscale.dtype == torch.float16:
                            param.grad = to_unscale = to_unscale.coalesce()
                        to_unscale = to_unscale._values()
                    grads[to_unscale.device][to_unscale.dtype].append(to_unscale)
            for device, per_dtype in grads.items():
                for group_grads in per_dtype.values():
                    if self._dynamic:
                        torch._amp_foreach_non_finite_check_and_unscale_(
                            group_grads,
                            per_device_found_inf.get(device),
                            per_device_inv_scale.get(device),
                        )
                        # torch_npu reads the flag on the host here
                        if per_device_found_inf.get(device).item() > 0:
                            self._has_overflow = True
                    else:
                        for grad in group_grads:
                            grad.mul_(per_device_inv_scale.get(device))
            if self._has_overflow:
                per_device_found_inf.get(found_inf.device).add_(1)
        return per_device_found_inf._per_device_tensors

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        assert self._scale is not None
        inv_scale = self._scale.float().reciprocal()
        found_inf = torch.full((), 0.0, dtype=torch.float32).pin_memory()
        found_inf = found_inf.to(self._scale.device, non_blocking=True)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, False)
        state["stage"] = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # torch_npu hands itself over (the old contract torch deprecated)
            retval = optimizer.step(*args, **dict(kwargs, grad_scaler=self))
            state["stage"] = OptState.STEPPED
            return retval
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise RuntimeError("No inf checks were recorded for this optimizer.")
        retval = None
        # torch_npu reads the found_inf flags on the host to decide
        found = self._dynamic and (
            sum(v.item() for v in state["found_inf_per_device"].values()) or self._has_overflow
        )
        if not found:
            retval = optimizer.step(*args, **kwargs)
        else:
            print("Gradient overflow. Skipping step")
        state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self._enabled:
            return
        _scale, _ = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, float):
                self._scale = torch.full((), new_scale, dtype=torch.float32).pin_memory()
                self._scale = self._scale.to(_scale.device, non_blocking=True)
            else:
                reason = (
                    "new_scale should be a float or a 1-element torch.npu.FloatTensor with "
                    "requires_grad=False."
                )
                if not isinstance(new_scale, torch.Tensor) or new_scale.device.type != "npu":
                    raise TypeError(reason)
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise ValueError(reason)
                self._scale = new_scale
        elif self._dynamic:
            self._npu_update_scale()
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._has_overflow = False

    def _npu_update_scale(self) -> None:
        assert self._scale is not None and self._growth_tracker is not None
        if self._has_overflow:
            self._scale.mul_(self._backoff_factor)
            self._growth_tracker.zero_()
            print(f"Loss scaler reducing loss scale to {self._scale.item()}")
            return
        self._growth_tracker.add_(1)
        if self._growth_tracker.item() == self._growth_interval:
            new_scale = self._scale * self._growth_factor
            if not torch.isinf(new_scale):
                self._scale = new_scale
            self._growth_tracker.zero_()
            print(f"Loss scaler increasing loss scale to {self._scale.item()}")

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._enabled:
            state["dynamic"] = self._dynamic
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        super().load_state_dict(state_dict)
        self._dynamic = state_dict["dynamic"]


__all__ = ["GradScaler", "autocast", "custom_bwd", "custom_fwd"]
