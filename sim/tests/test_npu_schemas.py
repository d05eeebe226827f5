"""The sim's registered op schemas against torch_npu 2.14's, field by field.

``data/torch_npu_2.14.0_schemas.json`` was extracted from the wheel by
``scripts/extract_npu_schemas.py`` (see its docstring to refresh it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from npusim import torch_npu  # also registers the ops

SNAPSHOT_FILE = Path(__file__).parent / "data" / "torch_npu_2.14.0_schemas.json"
SNAPSHOT = json.loads(SNAPSHOT_FILE.read_text())
SCHEMAS: dict[str, str] = SNAPSHOT["schemas"]

# torch_npu declares the output list of the .out overloads as ``Tensor[] out``; the sim
# declares ``Tensor(a!)[] out`` because its dispatcher learns what an op writes from the
# schema's write annotations. Likewise ``npu_apply_rotary_pos_emb`` updates query and key
# in place and returns them (op-plugin ApplyRotaryPosEmbNpuOpApi.cpp) under a schema that
# says neither. Names, types, defaults and keyword-only-ness still match.
WRITE_ANNOTATION_ADDED = {("npu_fused_infer_attention_score.out", "out"),
                          ("npu_fused_infer_attention_score_v2.out", "out"),
                          ("npu_apply_rotary_pos_emb", "query"),
                          ("npu_apply_rotary_pos_emb", "key")}  # fmt: skip
RETURNS_ALIASED_ADDED = {"npu_apply_rotary_pos_emb"}


def _registered(name: str) -> Any:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.npu, base), overload or "default")._schema


def _fields(arg: Any) -> tuple[Any, ...]:
    return (arg.name, str(arg.real_type), repr(arg.default_value), arg.kwarg_only)


def _alias(arg: Any) -> Any:
    info = arg.alias_info
    return None if info is None else (info.is_write, sorted(info.before_set))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_registered_schema_matches_the_wheel(name: str) -> None:
    want = torch._C.parse_schema(SCHEMAS[name])
    got = _registered(name)
    assert got.name == "npu::" + want.name
    assert got.overload_name == want.overload_name
    assert [a.name for a in got.arguments] == [a.name for a in want.arguments]
    for g, w in zip(got.arguments, want.arguments, strict=True):
        assert _fields(g) == _fields(w), f"{name}: argument {w.name}"
        if (name, w.name) in WRITE_ANNOTATION_ADDED:
            assert _alias(w) is None and g.alias_info is not None and g.alias_info.is_write
        else:
            assert _alias(g) == _alias(w), f"{name}: alias annotation of {w.name}"
    assert [str(r.real_type) for r in got.returns] == [str(r.real_type) for r in want.returns]
    if name in RETURNS_ALIASED_ADDED:
        assert all(_alias(r) is None for r in want.returns)
        assert all(r.alias_info is not None and r.alias_info.is_write for r in got.returns)
    else:
        assert [_alias(r) for r in got.returns] == [_alias(r) for r in want.returns]


def _default_text(v: Any) -> str:
    if v is None or isinstance(v, bool):
        return str(v)
    return f'"{v}"' if isinstance(v, str) else repr(v)


def _parser_arguments(text: str) -> list[tuple[str, str | None, bool]]:
    """(name, default, keyword-only) of a PythonArgParser signature with C++ types."""
    inner = text[text.index("(") + 1 : text.rindex(")")]
    out, kw_only = [], False
    for part in (p.strip() for p in inner.split(",")):
        if part == "*":
            kw_only = True
            continue
        decl, _, default = part.partition("=")
        out.append((decl.split()[-1], default or None, kw_only))
    return out


def test_fused_update_binding_takes_the_out_overloads_arguments() -> None:
    """``_C._npu_fused_infer_attention_score_out_graph(stream, handle, event, ...)`` parses
    the ``.out`` arguments: same names, defaults and keyword-only-ness."""
    parser = _parser_arguments(
        SNAPSHOT["python_arg_parser"]["_npu_fused_infer_attention_score_out_graph"]
    )
    out = _registered("npu_fused_infer_attention_score.out")
    mine = []
    for a in out.arguments:
        default = _default_text(a.default_value) if a.has_default_value() else None
        mine.append((a.name, default, a.kwarg_only))
    assert [m[0] for m in mine] == [p[0] for p in parser]
    for m, p in zip(mine, parser, strict=True):
        assert m[2] == p[2], m[0]
        if p[1] is not None:
            assert re.sub(r"\.0$", "", p[1]) == re.sub(r"\.0$", "", m[1] or ""), m[0]
    assert torch_npu._C._npu_fused_infer_attention_score_out_graph is not None
