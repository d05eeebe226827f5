"""A program named ``module:attr`` in the config, imported from ``sys.path``.

For trying a program out without packaging it: ``name = "my_prefill:PrefillProgram"``
in a ``[[programs]]`` table. ``attr`` (dotted for a nested attribute) is a
factory that takes the table, or a :class:`GraphProgram` subclass, built with
its ``from_config`` classmethod when it has one and with no arguments otherwise.
A shipped program should use an entry point instead (see docs/programs.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from .base import GraphProgram, ProgramConfigError


def factory_by_path(kind: str) -> Callable[[Mapping[str, Any]], GraphProgram]:
    module_name, _, attr = kind.partition(":")
    if not module_name or not attr:
        raise ProgramConfigError(f"programs.{kind}.name", f"{kind!r}: expected module:attr")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ProgramConfigError(
            f"programs.{kind}.name", f"{kind!r}: module {module_name!r} failed to import: {exc}"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ProgramConfigError(
                f"programs.{kind}.name", f"{kind!r}: {module_name} has no attribute {attr!r}"
            ) from None
    if isinstance(obj, type) and issubclass(obj, GraphProgram):
        cls = obj
        if hasattr(cls, "from_config"):
            return cls.from_config
        return lambda raw: cls()
    if not callable(obj):
        raise ProgramConfigError(f"programs.{kind}.name", f"{kind!r} is not callable")
    return obj
