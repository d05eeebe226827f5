"""What a captured graph will cost on the device: its tasks, counted by kind and op.

:func:`graph_profile` reads the graph's captured nodes (the capture stream's and every
side stream's branch) and sorts each task by where it runs on an Atlas A2, from the
op-support data (:mod:`.opsupport`):

- ``kernels``: device kernels (AI Core, or a unit the data does not know);
- ``aicpu``: kernels that run on the AI CPU (slow: each is a task of the AI CPU
  scheduler, not of the AI Cores);
- ``memcpy``: copies, by direction ("H2D", "D2H", "D2D");
- ``host_syncs``: tasks that make the host wait for the device. A capture refuses them
  (a captured stream cannot be synchronized), so a graph the sim captured has none;
  the count is there so that a program author reads it as zero, not as unknown;
- ``events``: captured event records, waits and resets;
- ``extensions``: the sim extensions its tasks used (not the NPU's: see
  :mod:`.extensions`);
- ``stretches``: the capture stream's own tasks (kernels, AI CPU tasks and copies) between
  its ExternalEvent waits: before the first, between each two, after the last (where a
  replay runs on without waiting for the host: a timed replay's floor).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .events import ExtWaitWork
from .graphs import TaskNode
from .opsupport import op_name, support_of
from .runtime import RUNTIME

_H2D, _D2H = "copy host->npu", "copy npu->host"


def _frozen(c: Counter[str]) -> Mapping[str, int]:
    return MappingProxyType(dict(sorted(c.items())))


@dataclass(frozen=True)
class GraphProfile:
    """The device tasks of one captured graph, by kind and op (see :mod:`.profile`)."""

    graph: str
    kernels: Mapping[str, int] = field(default_factory=dict)
    aicpu: Mapping[str, int] = field(default_factory=dict)
    memcpy: Mapping[str, int] = field(default_factory=dict)
    host_syncs: int = 0
    events: int = 0
    extensions: frozenset[str] = frozenset()
    stretches: tuple[int, ...] = (0,)

    @property
    def kernel_count(self) -> int:
        return sum(self.kernels.values())

    @property
    def aicpu_count(self) -> int:
        return sum(self.aicpu.values())

    @property
    def memcpy_count(self) -> int:
        return sum(self.memcpy.values())

    def __str__(self) -> str:
        def by_op(c: Mapping[str, int]) -> str:
            return ", ".join(f"{op} x{n}" for op, n in c.items()) or "none"

        lines = [
            f"{self.graph}: {self.kernel_count} device kernels, {self.aicpu_count} AI CPU "
            f"tasks, {self.memcpy_count} memcpys, {self.host_syncs} host syncs, "
            f"{self.events} event tasks",
            f"  kernels: {by_op(self.kernels)}",
            f"  AI CPU:  {by_op(self.aicpu)}",
            f"  memcpy:  {by_op(self.memcpy)}",
        ]
        if self.extensions:
            lines.append(
                f"  sim extensions used (not the NPU's): {', '.join(sorted(self.extensions))}"
            )
        return "\n".join(lines)


def graph_profile(graph: Any) -> GraphProfile:
    """The profile of captured graph ``graph`` (a ``torch.npu.NPUGraph`` of the sim);
    a graph with nothing captured has an empty one."""
    kernels: Counter[str] = Counter()
    aicpu: Counter[str] = Counter()
    memcpy: Counter[str] = Counter()
    events = 0
    with RUNTIME.cond:
        nodes = list(graph.nodes)
        own = len(nodes)
        for branch in graph.branches:
            nodes += branch.nodes
        used = frozenset(graph.extensions)
    stretches, n = [], 0
    for node in nodes[:own]:
        if type(node) is TaskNode:
            n += 1
        elif type(node) is ExtWaitWork:
            stretches.append(n)
            n = 0
    stretches.append(n)
    for node in nodes:
        if not isinstance(node, TaskNode):
            label = getattr(node, "label", "")
            if label.startswith(("record ", "wait ", "reset ")):
                events += 1
            else:  # a device-side sleep, the one other task a capture records
                kernels[label.partition("(")[0] or type(node).__name__] += 1
            continue
        call = node.call
        if call.label == _H2D:
            memcpy["H2D"] += 1
        elif call.label == _D2H:
            memcpy["D2H"] += 1
        elif getattr(call.op, "_schema", None) is None:
            kernels[call.label] += 1
        elif op_name(call.op) == "copy_":
            memcpy["D2D"] += 1
        elif support_of(call.op).aicpu:
            aicpu[op_name(call.op)] += 1
        else:
            kernels[op_name(call.op)] += 1
    return GraphProfile(
        graph.name, _frozen(kernels), _frozen(aicpu), _frozen(memcpy), 0, events, used,
        tuple(stretches),
    )
