"""``torch.npu.make_graphed_callables``: torch_npu 2.14's (``npu/graphs.py``, a port of
torch's ``torch.cuda.make_graphed_callables``), training graphs included.

Each callable's forward is captured into one graph and, when an output requires grad,
its backward (``torch.autograd.grad`` of the outputs with respect to the inputs and the
module's parameters that require grad) into a second graph; both share one memory pool.
The returned callable is an autograd Function whose forward copies the inputs into the
static inputs and replays the forward graph, and whose backward copies the incoming
gradients into the static gradient buffers and replays the backward graph. A Module
keeps its eager forward for the other training mode (``eval()`` after graphing in
training mode runs eagerly).

torch_npu's checks, kept: autocast with its cache enabled is refused (the cached casts
would be captured and freed), as are Modules with hooks registered, buffers that require
grad, and sample arguments that are not all tensors; with ``allow_unused_input=False``
an input that no output depends on is autograd's error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .allocation import graph_pool_handle
from .capture import graph
from .device import synchronize
from .graphs import NPUGraph
from .streams import Stream
from .streams import stream as stream_ctx


def _check(callables: tuple[Any, ...], sample_args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    if torch.is_autocast_enabled("npu") and torch.is_autocast_cache_enabled():
        raise RuntimeError(
            "make_graphed_callables does not support the autocast caching. Please set "
            "`cache_enabled=False`."
        )
    flat_args = []
    for c, args in zip(callables, sample_args, strict=True):
        if isinstance(c, torch.nn.Module):
            if c._backward_hooks or c._forward_hooks or c._forward_pre_hooks:
                raise RuntimeError(
                    "Modules must not have hooks registered at the time they are passed. "
                    "However, registering hooks on modules after passing them through "
                    "make_graphed_callables is allowed."
                )
            if any(b.requires_grad for b in c.buffers()):
                raise RuntimeError(
                    "In any :class:`~torch.nn.Module` passed to :func:`~make_graphed_callables`,"
                    " only parameters may be trainable. All buffers must have "
                    "``requires_grad=False``."
                )
        flat = tuple(pytree.arg_tree_leaves(*args))
        if not all(isinstance(a, torch.Tensor) for a in flat):
            raise RuntimeError(
                "In the beta API, sample_args for each callable must contain only Tensors. "
                "Other types are not allowed."
            )
        flat_args.append(flat)
    return flat_args


def _grads(
    outputs: tuple[torch.Tensor, ...],
    surface: tuple[torch.Tensor, ...],
    grad_outputs: tuple[torch.Tensor, ...],
    allow_unused: bool,
) -> tuple[torch.Tensor | None, ...]:
    return torch.autograd.grad(
        outputs=outputs,
        inputs=tuple(i for i in surface if i.requires_grad),
        grad_outputs=grad_outputs,
        only_inputs=True,
        allow_unused=allow_unused,
    )


def make_graphed_callables(
    callables: Any, sample_args: Any, num_warmup_iters: int = 3,
    allow_unused_input: bool = False, pool: Any = None,
) -> Any:  # fmt: skip
    """Graphed versions of ``callables`` (a callable or a tuple of them, in the order they
    run), captured with ``sample_args`` (a tuple of tensors for each)."""
    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args = (callables,), (sample_args,)
    flat_args = _check(callables, sample_args)
    params = [tuple(c.parameters()) if isinstance(c, torch.nn.Module) else () for c in callables]
    surfaces = [flat_args[i] + params[i] for i in range(len(callables))]
    fwd_graphs = [NPUGraph() for _ in callables]
    bwd_graphs = [NPUGraph() for _ in callables]
    mempool = graph_pool_handle() if pool is None else pool

    # Warm up on a side stream (lazy initialisation, autograd's buffers), forward and backward.
    synchronize()
    with stream_ctx(Stream()):
        for func, args, surface in zip(callables, sample_args, surfaces, strict=True):
            for _ in range(num_warmup_iters):
                outputs = pytree.tree_leaves(func(*args))
                needed = tuple(o for o in outputs if o.requires_grad)
                if needed:
                    _grads(
                        needed,
                        surface,
                        tuple(torch.empty_like(o) for o in needed),
                        allow_unused_input,
                    )
    synchronize()

    # Forward graphs in the order the callables run, backward graphs in reverse.
    static_outputs: list[tuple[torch.Tensor, ...]] = []
    specs: list[pytree.TreeSpec] = []
    for func, args, fwd in zip(callables, sample_args, fwd_graphs, strict=True):
        with graph(fwd, pool=mempool):
            outputs = func(*args)
        flat, spec = pytree.tree_flatten(outputs)
        static_outputs.append(tuple(flat))
        specs.append(spec)

    static_grad_outputs: list[tuple[torch.Tensor | None, ...]] = []
    static_grad_inputs: list[tuple[torch.Tensor | None, ...]] = []
    for surface, outs, bwd in zip(
        reversed(surfaces), reversed(static_outputs), reversed(bwd_graphs), strict=True
    ):
        grad_outs = tuple(torch.empty_like(o) if o.requires_grad else None for o in outs)
        needed = tuple(o for o in outs if o.requires_grad)
        grads: tuple[torch.Tensor | None, ...] | None = None
        if needed:
            with graph(bwd, pool=mempool):
                grads = _grads(
                    needed, surface, tuple(g for g in grad_outs if g is not None),
                    allow_unused_input,
                )  # fmt: skip
        per_input: list[torch.Tensor | None] = []
        it = iter(grads or ())
        for arg in surface:
            per_input.append(next(it) if arg.requires_grad and grads is not None else None)
        static_grad_outputs.append(grad_outs)
        static_grad_inputs.append(tuple(per_input))
    static_grad_outputs.reverse()
    static_grad_inputs.reverse()

    ret: list[Any] = []
    for i, func in enumerate(callables):
        graphed = _graphed_function(
            fwd_graphs[i], bwd_graphs[i], params[i], len(flat_args[i]), specs[i],
            surfaces[i], static_outputs[i], static_grad_outputs[i], static_grad_inputs[i],
        )  # fmt: skip
        if isinstance(func, torch.nn.Module):
            func.forward = _mode_switch(func, func.training, graphed, func.forward)
            ret.append(func)
        else:
            ret.append(graphed)
    return ret[0] if single else tuple(ret)


def _graphed_function(
    fwd_graph: NPUGraph,
    bwd_graph: NPUGraph,
    module_params: tuple[torch.Tensor, ...],
    n_user_args: int,
    spec: pytree.TreeSpec,
    surface: tuple[torch.Tensor, ...],
    outputs: tuple[torch.Tensor, ...],
    grad_outputs: tuple[torch.Tensor | None, ...],
    grad_inputs: tuple[torch.Tensor | None, ...],
) -> Callable[..., Any]:
    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            for i in range(n_user_args):
                if surface[i].data_ptr() != inputs[i].data_ptr():
                    surface[i].copy_(inputs[i])
            fwd_graph.replay()
            return tuple(o.detach() for o in outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            if len(grads) != len(grad_outputs):
                raise RuntimeError(
                    "The length of grads is not equal with the length of static_grad_outputs."
                )
            for static, grad in zip(grad_outputs, grads, strict=True):
                if static is not None and static.data_ptr() != grad.data_ptr():
                    static.copy_(grad)
            bwd_graph.replay()
            return tuple(g.detach() if g is not None else None for g in grad_inputs)

    def functionalized(*user_args: Any) -> Any:
        flat = tuple(pytree.arg_tree_leaves(*user_args))
        out = Graphed.apply(*(flat + module_params))
        return pytree.tree_unflatten(out, spec)

    return functionalized


def _mode_switch(
    module: torch.nn.Module, graphed_training: bool, graphed: Callable[..., Any],
    eager: Callable[..., Any],
) -> Callable[..., Any]:  # fmt: skip
    def forward(*user_args: Any) -> Any:
        if module.training == graphed_training:
            return graphed(*user_args)
        return eager(*user_args)

    return forward
