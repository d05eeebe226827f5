"""Graph programs and their registry.

Built-in: ``attention`` (:mod:`.attention`), ``paged_attention``
(:mod:`.paged_attention`, decode over a paged KV cache the program keeps on the device)
and ``model`` (:mod:`.model`, the whole decode forward of a Llama-family model:
docs/models.md).
Other packages add programs through the entry point group ``graphlane.programs``: the
entry point names the program and loads a callable that takes the program's
configuration mapping (the ``[[programs]]`` table of the config, ``name`` included) and
returns a :class:`~graphlane.workers.programs.base.GraphProgram`. For trying things out,
a ``[[programs]]`` name may also be ``module:attr`` (``attr`` may be dotted): such a
callable, or a GraphProgram subclass (its ``from_config`` if it has one, else the class
called with no arguments), imported from ``sys.path``. See docs/programs.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from .attention import AttentionConfig, AttentionProgram
from .base import (
    CapturedGraph,
    GraphKey,
    GraphProgram,
    OpCall,
    ProgramConfigError,
    StepError,
    StepPlan,
)
from .model import ModelConfig, ModelProgram
from .paged_attention import PagedAttentionConfig, PagedAttentionProgram

ProgramFactory = Callable[[Mapping[str, Any]], GraphProgram]

ENTRY_POINT_GROUP = "graphlane.programs"
_BUILTIN: dict[str, ProgramFactory] = {
    "attention": AttentionProgram.from_config,
    "paged_attention": PagedAttentionProgram.from_config,
    "model": ModelProgram.from_config,
}


def available_programs() -> list[str]:
    """Names of the built-in programs and of those installed under the
    ``graphlane.programs`` entry points (nothing is imported to list them)."""
    names = set(_BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def _factory(kind: str) -> ProgramFactory | None:
    """The factory of ``kind``: a built-in, else its entry point, the only one imported
    (a broken plugin of another name cannot stop this one from loading)."""
    if kind in _BUILTIN:
        return _BUILTIN[kind]
    if ":" in kind:
        from .by_path import factory_by_path

        return factory_by_path(kind)
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=kind):
        try:
            factory: ProgramFactory = ep.load()
        except Exception as exc:
            raise ProgramConfigError(
                f"programs.{kind}.name", f"program {kind!r} ({ep.value}) failed to import: {exc}"
            ) from exc
        return factory
    return None


def load_program(kind: str, config: Mapping[str, Any]) -> GraphProgram:
    """Build the program registered as ``kind`` from its configuration mapping."""
    factory = _factory(kind)
    if factory is None:
        raise ProgramConfigError(
            f"programs.{kind}.name", f"unknown program {kind!r} (available: {available_programs()})"
        )
    program = factory(config)
    if not isinstance(program, GraphProgram):
        raise ProgramConfigError(f"programs.{kind}.name", f"{kind!r} did not build a GraphProgram")
    return program


__all__ = [
    "AttentionConfig",
    "AttentionProgram",
    "CapturedGraph",
    "GraphKey",
    "GraphProgram",
    "ModelConfig",
    "ModelProgram",
    "OpCall",
    "PagedAttentionConfig",
    "PagedAttentionProgram",
    "ProgramConfigError",
    "StepError",
    "StepPlan",
    "available_programs",
    "load_program",
]
