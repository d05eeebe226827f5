"""The stream a backward pass runs on.

On the NPU (as with CUDA), autograd runs each backward op on the stream its forward op
ran on, makes that stream wait for the stream current at ``backward()`` (the ambient
stream, where the initial gradients were made) and makes the ambient stream wait for
the backward's last ops (torch's "stream semantics of backward passes"; torch_npu's
device guard gives the engine the streams). A backend written in Python cannot give
the engine streams (torch's Python device guard answers every stream query with the
default stream), and the engine runs a device's backward ops on a thread of its own,
which has no current stream of its own.

The sim runs the backward ops of a pass on the ambient stream: exact for the common
shape (forward and backward on one stream: a training step, a capture of forward and
backward as ``make_graphed_callables`` does), and ordered as the NPU orders a forward
on another stream, without the two waits. It wraps autograd's engine entry point
(``Variable._execution_engine.run_backward``, which ``Tensor.backward``,
``torch.autograd.backward`` and ``torch.autograd.grad`` all call) to note the ambient
stream of each device for the pass, and :func:`.streams.current_stream` answers with
it on the engine's thread while a node runs there.
"""

from __future__ import annotations

from typing import Any

from torch.autograd.variable import Variable

from .runtime import RUNTIME
from .streams import BACKWARD_AMBIENT, current_stream


class _Engine:
    """Autograd's engine with the ambient streams noted around each pass."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        ambient = {i: current_stream(i) for i in range(RUNTIME.device_count)}
        BACKWARD_AMBIENT.append(ambient)
        try:
            return self._engine.run_backward(*args, **kwargs)
        finally:
            BACKWARD_AMBIENT.remove(ambient)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def install() -> None:
    """Idempotent."""
    engine = Variable._execution_engine
    if not isinstance(engine, _Engine):
        Variable._execution_engine = _Engine(engine)  # type: ignore[assignment]
