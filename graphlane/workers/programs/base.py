"""What a graph program is: what gets captured, and how a step's parameters patch it.

A program is captured once per batch-size bucket (``depth`` instances in a
ring). Its captured graph consists of *task groups*, each preceded by its own
ExternalEvent wait; a step patches each group whose parameters changed and
releases every group's event exactly once per replay. The step engine
(:mod:`graphlane.workers.engine`) owns the ordering; a program only says
which buffers exist, what is captured, how a step's parameters and inputs are
validated, and which op each group re-issues with which arguments
(:meth:`GraphProgram.group_call`): the engine and the backend know no op.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import torch

from graphlane.program_config import ProgramConfigError
from graphlane.workers.backends.base import DeviceBackend


class StepError(ValueError):
    """A step request that cannot run: ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


COMPUTE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""The dtypes a program's ``dtype`` key may name."""


def config_values(fields: Iterable[str], raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A program's config keys from ``raw`` (its ``[[programs]]`` table): an unknown key
    is refused naming it; ``buckets`` becomes a tuple."""
    known = set(fields)
    for key in raw:
        if key not in known and key != "name":
            raise ProgramConfigError(f"{where}.{key}", f"unknown key (known: {sorted(known)})")
    values = {k: raw[k] for k in known if k in raw}
    if "buckets" in values:
        b = values["buckets"]
        if not isinstance(b, (list, tuple)) or not b:
            raise ProgramConfigError(f"{where}.buckets", "must be a non-empty list of batch sizes")
        values["buckets"] = tuple(b)
    return values


FIA_OUT = "npu_fused_infer_attention_score.out"  # the op every attention layer's group runs
FIA_WORKSPACE = "_npu_fused_infer_attention_score_get_max_workspace"
LENGTHS = "actual_seq_lengths_kv"  # the one parameter of the attention-shaped programs


def kv_lengths(params: Mapping[str, Any], batch: int, limit: int, why: str) -> Any:
    """A step's ``actual_seq_lengths_kv``, its only parameter: ``batch`` ints in
    1..``limit`` (``why`` says where the limit comes from); StepError naming the
    parameter otherwise."""
    for key in params:
        if key != LENGTHS:
            raise StepError(f"params.{key}", f"unknown parameter (known: {LENGTHS})")
    if LENGTHS not in params:
        raise StepError(f"params.{LENGTHS}", "is required")
    lengths = params[LENGTHS]
    if not isinstance(lengths, (list, tuple)) or len(lengths) != batch:
        raise StepError(f"params.{LENGTHS}", f"must be a list of {batch} lengths (one per row)")
    for i, n in enumerate(lengths):
        if type(n) is int and 1 <= n <= limit:  # the common case first
            continue
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= limit:
            raise StepError(
                f"params.{LENGTHS}[{i}]", f"{n!r} is not a length in 1..{limit} ({why})"
            )
    return lengths


def check_attention_config(config: Any, ints: Iterable[str], where: str) -> None:
    """The checks every attention-shaped config shares: positive ``ints``, heads that
    group (GQA, at most 64 query heads per KV head), distinct positive buckets, a dtype."""
    for key in ints:
        v = getattr(config, key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ProgramConfigError(f"{where}.{key}", f"must be a positive integer, not {v!r}")
    if config.num_heads % config.num_kv_heads:
        raise ProgramConfigError(
            f"{where}.num_kv_heads",
            f"{config.num_kv_heads} must divide num_heads {config.num_heads}",
        )
    if config.num_heads // config.num_kv_heads > 64:
        raise ProgramConfigError(f"{where}.num_kv_heads", "num_heads/num_kv_heads must be <= 64")
    for b in config.buckets:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ProgramConfigError(f"{where}.buckets", f"{b!r} is not a positive batch size")
    if len(set(config.buckets)) != len(config.buckets):
        raise ProgramConfigError(f"{where}.buckets", "batch sizes must be distinct")
    if config.dtype not in COMPUTE_DTYPES:
        raise ProgramConfigError(f"{where}.dtype", f"must be one of {sorted(COMPUTE_DTYPES)}")
    check_caps(config, where)


#: Caps of a program's config that bound one another: (the smaller, the larger, why).
#: A config that sets the smaller above the larger is refused: the first could never be
#: reached, so a user who raised it would be bounded by the other without being told.
#: (A block table wider than the cache, max_blocks_per_seq > num_blocks, is no such pair:
#: the table's width is a captured shape, and a scheduler bounds a sequence by both.)
CAPS = (
    ("max_sequences_per_client", "max_sequences",
     "one client's sequences count against the worker's total"),
)  # fmt: skip


def check_caps(config: Any, where: str) -> None:
    """ProgramConfigError naming both keys when a cap of :data:`CAPS` that ``config`` has
    is larger than the cap that bounds it."""
    for small, large, why in CAPS:
        a, b = getattr(config, small, None), getattr(config, large, None)
        if isinstance(a, int) and isinstance(b, int) and a > b:
            raise ProgramConfigError(
                f"{where}.{small}",
                f"{a} is more than {where}.{large} = {b} ({why}): lower it, or raise {large}",
            )


@dataclass(frozen=True)
class GraphKey:
    """Identifies one captured graph instance: (program, bucket, instance), the
    instance being its position in the bucket's ring of ``depth`` instances."""

    program: str
    bucket: int
    instance: int


@dataclass(eq=False)
class CapturedGraph:
    """One captured graph instance with its task-group handles, events and static buffers."""

    key: GraphKey
    graph: Any
    handles: list[Any]
    events: list[Any]
    buffers: dict[str, torch.Tensor]
    signatures: list[Any]  # parameters each group currently holds (to skip unchanged)
    last_done: Any = None  # event recorded after this instance's latest replay
    # The instance's tail graphs by name (GraphProgram.tails): replayed after it, on
    # the same stream, by the steps that need them.
    tails: dict[str, Any] = field(default_factory=dict)
    # What the instance costs on the device (a backend that can tell: the sim's
    # npusim.graph_profile), the main graph's and each tail's; None otherwise.
    profile: dict[str, Any] | None = None


class Feed(Protocol):
    """What :meth:`GraphProgram.feeds` returns: device work that writes a step's static
    buffers from device state, issued by the engine after the step's input copies."""

    def write(self, buffers: dict[str, torch.Tensor]) -> None: ...


@dataclass(frozen=True)
class DeviceFeed:
    """A copy on the device into a step's static buffer from device state, with no host
    round trip: the output of an earlier step (decoding ahead: a row's token is the one
    its sequence sampled in its previous step), or rows a program gathered from state it
    keeps (a model's persistent batch). The engine issues it on the capture
    stream after the step's input copies: every replay runs on that stream, so its
    order puts the copy after the earlier step's replay, which wrote ``source``."""

    source: torch.Tensor  # device rows of an earlier step's output
    buffer: str  # the static buffer of this step's instance written to
    index: Any  # where in it: ``buffers[buffer][index].copy_(source)``

    def write(self, buffers: dict[str, torch.Tensor]) -> None:
        """Issue the copy into ``buffers`` (the step's instance's), on the current stream.
        A feed of another shape (a gather straight into the buffers: the model's
        persistent batch) is any object with this method."""
        buffers[self.buffer][self.index].copy_(self.source)


OpCall = tuple[str, tuple[Any, ...], dict[str, Any]]
"""``(op, args, kwargs)``: an op of torch_npu's namespace by name, and its arguments."""


class StepPlan(msgspec.Struct, frozen=True):
    """A validated step: the bucket it runs on and program-specific values. (A Struct,
    not a dataclass: one is made per step, and a frozen dataclass's ``__init__``
    costs four times as much.)"""

    program: str
    batch: int
    bucket: int
    values: Mapping[str, Any] = {}  # each plan gets an empty dict of its own
    inputs: Mapping[str, torch.Tensor] = {}


class GraphProgram(abc.ABC):
    """Base class of graph programs. Subclasses set ``name`` and implement the hooks."""

    name: str = ""
    #: batch sizes captured, ascending
    buckets: tuple[int, ...] = ()
    #: names of the outputs a step may ask for
    outputs: tuple[str, ...] = ()
    #: the step parameter whose list has one entry per batch row: a step that does not
    #: name its ``batch`` has the length of that list (None: every step must name it)
    batch_param: str | None = None
    #: step parameters by name, with what each means (for ``hello``)
    parameters: Mapping[str, str] = {}
    #: True when :meth:`plan` checks the shape and dtype of every input itself; else
    #: the engine checks each input against the static buffer it is written into
    checks_inputs: bool = False
    #: small graphs captured per instance after the main one, over its buffers, and
    #: replayed right after it only by the steps that need them (:meth:`tails_for`): work
    #: that most steps skip (a sampler when a batch is all greedy) costs those steps
    #: nothing on the device
    tails: tuple[str, ...] = ()
    #: operations on device state the program owns (a paged KV cache), by name, with
    #: what each does; a program with any is *stateful*: its requests name the worker
    #: generation they expect (see :meth:`plan_state`, :meth:`run_state`)
    state_ops: Mapping[str, str] = {}
    #: True when :meth:`input_writes` gives copies for group 0 alone (every input lands
    #: before the first group): the engine then asks for group 0's only, not once per group
    inputs_before_first_group: bool = False
    #: True when :meth:`group_signature` is the same for every group of a step (the
    #: step's lengths): the engine then asks once per step, not once per group
    step_wide_signature: bool = False

    @property
    def replayable(self) -> bool:
        """Whether ``replay`` (run a graph instance as last patched) and ``update`` (patch
        one for a later replay or step) are offered. Not for
        a program with device state: its graphs write that state (a paged cache's new
        tokens) from the instance's static buffers, which hold whatever step ran on the
        instance last, maybe another client's, into slots since handed to other
        sequences; and its outputs would come from that step's query and block table.
        Such a program's clients send steps, which carry all their inputs."""
        return not self.state_ops

    #: the dtype (a :data:`COMPUTE_DTYPES` name) the program's fused attention runs in,
    #: None if it has none: what :meth:`check_backend` checks
    attention_dtype: str | None = None

    def check_backend(self, backend: str) -> None:
        """ProgramConfigError naming the setting when ``backend`` ("sim", "npu", "null")
        cannot run this program as configured: float32 fused attention on an NPU (its
        kernels take float16 and bfloat16, torch_npu 2.14; the sim runs it only as a
        named extension, an exact reference)."""
        if backend == "npu" and self.attention_dtype == "float32":
            raise ProgramConfigError(
                f"programs.{self.name}.dtype",
                "float32 is not served on backend 'npu' (the NPU's fused attention takes "
                'float16 and bfloat16): set dtype = "bfloat16", or use backend = "sim" '
                "for a float32 reference",
            )

    def describe(self) -> dict[str, Any]:
        """What ``hello`` tells clients about this program (JSON values). Subclasses
        add ``inputs`` and ``output_shapes`` (name -> {"shape": [...], "dtype": str},
        "batch" standing for the batch size: any of ``buckets`` or less), ``config``
        (every setting) and, with device state, ``state`` (its kind and sizes)."""
        return {
            "buckets": list(self.buckets),
            "outputs": list(self.outputs),
            "groups": self.num_groups,
            "batch_param": self.batch_param,
            "parameters": dict(self.parameters),
            "state_ops": dict(self.state_ops),
            "replay": self.replayable,
        }

    def infer_batch(self, params: Mapping[str, Any]) -> int:
        """The batch of a step that did not name one; StepError("batch", ...) if the
        program cannot tell."""
        values = params.get(self.batch_param) if self.batch_param else None
        if isinstance(values, list | tuple) and values:
            return len(values)
        hint = f" or give params.{self.batch_param} as a list" if self.batch_param else ""
        raise StepError("batch", f"is required for program {self.name!r}{hint}")

    @property
    @abc.abstractmethod
    def num_groups(self) -> int:
        """Task groups per captured graph (each has its own ExternalEvent)."""

    def bucket_for(self, batch: int) -> int:
        """The smallest captured bucket that holds ``batch``; StepError("batch", ...) for a
        batch that is not a positive int or is larger than every bucket."""
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise StepError("batch", f"must be a positive integer, not {batch!r}")
        for b in self.buckets:
            if b >= batch:
                return b
        raise StepError(
            "batch", f"{batch} is larger than every captured bucket {list(self.buckets)}"
        )

    @abc.abstractmethod
    def allocate(self, backend: DeviceBackend, bucket: int) -> dict[str, torch.Tensor]:
        """Static device buffers of one graph instance."""

    @abc.abstractmethod
    def capture(
        self,
        backend: DeviceBackend,
        stream: Any,
        bucket: int,
        buffers: dict[str, torch.Tensor],
        events: list[Any],
    ) -> tuple[list[Any], list[Any]]:
        """Record the graph's work on ``stream`` (inside a capture).

        Each group must be preceded by ``backend.wait_external(stream, events[g])``
        (the wait and its reset) and issue its op
        with ``backend.call(op, args, kwargs)`` between ``backend.task_group_begin``
        and ``backend.task_group_end``. Returns the task-group handles and each
        group's captured parameter signature.
        """

    @abc.abstractmethod
    def plan(
        self, batch: int, params: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]
    ) -> StepPlan:
        """Validate a step; raise StepError naming the field."""

    @abc.abstractmethod
    def group_signature(self, plan: StepPlan, group: int) -> Any:
        """The parameters group ``group`` needs for this step (compared to skip patches)."""

    @abc.abstractmethod
    def group_call(self, buffers: dict[str, torch.Tensor], plan: StepPlan, group: int) -> OpCall:
        """The op group ``group`` re-issues for this step, and its arguments: ``(op,
        args, kwargs)``, ``op`` named as in torch_npu's namespace (a dotted name such
        as ``"npu_fused_infer_attention_score.out"``). The same op on the same tensors
        as captured, with this step's parameters; the backend patches the group with
        it (:meth:`DeviceBackend.patch`)."""

    def group_calls(self, buffers: dict[str, torch.Tensor], plan: StepPlan) -> list[OpCall]:
        """Every group's :meth:`group_call` for this step, in group order: what the engine
        asks of a program with :attr:`step_wide_signature` once its step's signature
        differs from what its groups hold (then every group is patched). Override it to
        make them in one pass."""
        return [self.group_call(buffers, plan, g) for g in range(self.num_groups)]

    def input_writes(
        self, buffers: dict[str, torch.Tensor], plan: StepPlan, group: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device destination, host source) copies that must land before group ``group`` runs."""
        return []

    #: True for a program whose :meth:`check_feeds` raises every refusal :meth:`feeds`
    #: would: the engine then hands a step's patches to the update thread before its
    #: feeds' device work (a refusal after that would be a fault of the engine's)
    checks_feeds_first: bool = False

    def check_feeds(self, plan: StepPlan, owner: Any = None) -> None:
        """Raise what :meth:`feeds` would refuse ``plan`` for, from host state alone, and
        issue nothing (see :attr:`checks_feeds_first`)."""
        return None  # a program that keeps no feeds refuses none

    def feeds(self, plan: StepPlan, owner: Any = None, checked: bool = False) -> list[Feed]:
        """The device-to-device copies a step needs beside its host inputs (each written
        by its ``write(buffers)``, into the instance the step runs on), resolved when
        it is issued (in issue order, after every step issued before it); an exception
        refuses this step alone (nothing of it was issued). Runs on the capture stream:
        device work it issues (copies into device state the program keeps, gathers that
        make the feeds' sources) is ordered after every replay issued before and before
        this step's. ``owner``: the client that
        sent it (its CURVE key, else its connection): state a program keeps per client
        (a model's sequences) is that client's alone. ``checked``: :meth:`check_feeds`
        passed for ``plan`` just before, with nothing issued between (what it checked
        need not be checked again)."""
        return []

    #: True for a program that keeps decoding sequences (the wire's add, decode,
    #: append_blocks, free: :meth:`plan_sequences`, :meth:`sequence_change`)
    sequence_ops: bool = False

    def plan_sequences(self, op: str, fields: Mapping[str, Any], owner: Any) -> StepPlan:
        """``add`` (a STATE job) or ``decode`` (a STEP job) of ``owner``'s sequences."""
        raise StepError("op", f"program {self.name!r} keeps no sequences")

    def sequence_change(self, op: str, fields: Mapping[str, Any], owner: Any) -> dict[str, Any]:
        """``append_blocks`` or ``free``: host bookkeeping, answered at once."""
        raise StepError("op", f"program {self.name!r} keeps no sequences")

    def release(self, owner: Any) -> int:
        """Forget ``owner``'s sequences (its client went); how many there were."""
        return 0

    def sequence_counts(self) -> dict[str, int]:
        """What the program keeps of its clients' sequences (worker status)."""
        return {}

    def issued(
        self, plan: StepPlan, graph: CapturedGraph | None, done: Any, owner: Any = None
    ) -> None:
        """Called by the issuing thread once a step (``graph`` its instance) or a
        device-state operation (``graph`` None) is issued, ``done`` recorded after it
        (``owner`` as in :meth:`feeds`). Device work it issues goes on the capture
        stream, behind the step: it may copy the step's outputs before a later replay
        of the instance rewrites them."""
        return None

    def capture_tail(
        self,
        backend: DeviceBackend,
        stream: Any,
        bucket: int,
        buffers: dict[str, torch.Tensor],
        name: str,
    ) -> None:
        """Record tail ``name`` (one of :attr:`tails`) on ``stream`` (inside a capture of
        its own, after the instance's main graph was captured): plain ops over
        ``buffers`` (the main graph's outputs included), no task groups."""
        raise NotImplementedError

    def tails_for(self, plan: StepPlan, outputs: Sequence[str]) -> Sequence[str]:
        """The tails a step replays after the main graph, in order (it asks for
        ``outputs``)."""
        return ()

    def plan_state(self, op: str, fields: Mapping[str, Any]) -> StepPlan:
        """Validate a device-state operation ``op`` (one of :attr:`state_ops`) with its
        request's fields; StepError naming the field. ``batch`` of the plan is free."""
        raise StepError("op", f"program {self.name!r} has no device-state operations")

    def run_state(self, backend: DeviceBackend, plan: StepPlan) -> dict[str, torch.Tensor]:
        """Issue a planned state operation on the current stream (the engine makes it
        the capture stream, in order with every replay); returns device tensors that the
        engine copies to the host as the reply's outputs."""
        raise NotImplementedError

    @abc.abstractmethod
    def output_views(
        self, buffers: dict[str, torch.Tensor], plan: StepPlan, names: list[str]
    ) -> dict[str, torch.Tensor]:
        """Device views of the requested outputs, without padding rows."""
