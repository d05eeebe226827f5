"""Extract what the strict torch_npu of the tests binds calls against, from a torch_npu wheel.

    python scripts/extract_torch_npu_api.py torch_npu-2.14.0-cp311-...whl \
        > tests/strict_npu/torch_npu/api_2.14.0.json

(get the wheel with ``pip download --no-deps torch-npu==2.14.0``; it is never
installed: it needs CANN). Nothing of the wheel is kept but what is printed:

- ``python``: the signatures of torch_npu.npu's device, stream, event and graph API,
  read from the wheel's Python sources with :mod:`ast` (parameter names, kinds and
  default values as source text);
- ``c_bindings``: the argument lists of the C bindings those Python wrappers call with
  keywords: the keyword lists and ``PyArg_ParseTupleAndKeywords`` formats of
  ``_NPUStreamBase`` and ``_NPUEventBase`` (Stream.cpp, Event.cpp build the keyword list
  on the stack; this script replays the disassembly's pointer stores to read it), and
  the PythonArgParser signature of ``_npu_fused_infer_attention_score_out_graph``;
- ``schemas``: the registered op schemas (``scripts/extract_npu_schemas.py``'s).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

#: module of the wheel -> names in it (``Class.method`` for methods).
PYTHON_API = {
    "torch_npu/npu/utils.py": (
        "set_device", "current_device", "synchronize", "stream", "set_stream",
        "current_stream", "default_stream", "device.__init__",
    ),
    "torch_npu/npu/__init__.py": ("device_count", "is_available"),
    "torch_npu/npu/streams.py": (
        "Stream.__new__", "Stream.wait_event", "Stream.wait_stream", "Stream.record_event",
        "Stream.query", "Stream.synchronize",
        "Event.__new__", "Event.record", "Event.wait", "Event.query", "Event.synchronize",
        "Event.elapsed_time",
        "ExternalEvent.__new__", "ExternalEvent.record", "ExternalEvent.wait",
        "ExternalEvent.reset",
    ),
    "torch_npu/npu/graphs.py": (
        "is_current_stream_capturing", "graph_pool_handle", "graph_task_group_begin",
        "graph_task_group_end", "graph_task_update_begin", "graph_task_update_end",
        "NPUGraph.__new__", "NPUGraph.__init__", "NPUGraph.capture_begin",
        "NPUGraph.capture_end", "NPUGraph.replay", "NPUGraph.reset", "NPUGraph.pool",
        "NPUGraph.update", "graph.__init__",
    ),
}  # fmt: skip

#: C bindings read from the disassembly, by a keyword that only their list holds.
KEYWORD_LISTS = {"_NPUStreamBase.__new__": "priority", "_NPUEventBase.__new__": "graph_external"}
_PYARG_FORMAT = re.compile(r"^\|?[bhilLKdfOpsz]+$")


def _parameters(fn: ast.FunctionDef) -> list[dict[str, Any]]:
    a = fn.args
    out: list[dict[str, Any]] = []
    positional = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
    defaults += a.defaults
    for arg, default in zip(positional, defaults, strict=True):
        kind = "POSITIONAL_ONLY" if arg in a.posonlyargs else "POSITIONAL_OR_KEYWORD"
        out.append(_param(arg.arg, kind, default))
    if a.vararg is not None:
        out.append(_param(a.vararg.arg, "VAR_POSITIONAL", None))
    for arg, kw_default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append(_param(arg.arg, "KEYWORD_ONLY", kw_default))
    if a.kwarg is not None:
        out.append(_param(a.kwarg.arg, "VAR_KEYWORD", None))
    return out


def _param(name: str, kind: str, default: ast.expr | None) -> dict[str, Any]:
    p: dict[str, Any] = {"name": name, "kind": kind}
    if default is not None:
        p["default"] = ast.unparse(default)
    return p


def python_signatures(wheel: zipfile.ZipFile) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for module, names in PYTHON_API.items():
        tree = ast.parse(wheel.read(module).decode())
        defs: dict[str, ast.FunctionDef] = {}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                defs[node.name] = node
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        defs[f"{node.name}.{item.name}"] = item
        for name in names:
            if name not in defs:
                sys.exit(f"{name} not found in {module}")
            found[name] = _parameters(defs[name])
    return found


def keyword_lists(lines: list[str], data: bytes) -> list[tuple[str, list[str]]]:
    """(format, keywords) of each PyArg_ParseTupleAndKeywords call whose keyword list the
    code builds on the stack: replay ``lea reg, [rip+string]``, ``movq xmm, reg``,
    ``punpcklqdq``, ``movaps [frame], xmm`` and ``mov [frame], reg/0`` between calls."""
    values: dict[str, list[int]] = {}  # register -> the 8-byte values it holds
    slots: dict[str, tuple[str, int]] = {}  # register -> the frame slot it points to
    frame: dict[tuple[str, int], int] = {}  # (base register, offset) -> 8-byte value
    found = []

    def text(addr: int) -> str | None:
        end = data.find(b"\0", addr, addr + 256)
        if addr <= 0 or end < 0:
            return None
        try:
            return data[addr:end].decode("ascii")
        except UnicodeDecodeError:
            return None

    def read_list(base: str, off: int) -> list[str]:
        names = []
        while frame.get((base, off)):
            name = text(frame[(base, off)])
            if name is None or not name.isidentifier():
                return []
            names.append(name)
            off += 8
        return names

    for line in lines:
        m = re.match(r"\s*[0-9a-f]+:\s+(\S+)\s*(.*)", line)
        if not m:
            continue
        op, args = m.groups()
        if op.startswith(("ret", "jmp")):
            values.clear()
            slots.clear()
            frame.clear()
            continue
        if op.startswith("call"):
            fmt = text(values["rdx"][0]) if "rdx" in values else None
            if fmt and _PYARG_FORMAT.match(fmt) and "rcx" in slots:
                names = read_list(*slots["rcx"])
                if names:
                    found.append((fmt, names))
            for r in ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11"):
                values.pop(r, None)
                slots.pop(r, None)
            frame.clear()
            continue
        dst = args.split(",", 1)[0]
        lea = re.match(r"(\w+),\[rip\+0x[0-9a-f]+\]\s+# ([0-9a-f]+)", args)
        slot = re.match(r"(\w+),\[(r[bs]p)([+-]0x[0-9a-f]+)?\]$", args)
        pair = re.match(r"(\w+),(\w+)$", args)
        store = re.match(r"(XMMWORD|QWORD) PTR \[(r[bs]p)([+-]0x[0-9a-f]+)?\],(\w+)$", args)
        if op == "lea" and lea:
            values[lea.group(1)] = [int(lea.group(2), 16)]
            slots.pop(lea.group(1), None)
        elif op == "lea" and slot:
            slots[slot.group(1)] = (slot.group(2), int(slot.group(3) or "0", 16))
            values.pop(slot.group(1), None)
        elif op in ("mov", "movq") and pair and (pair.group(2) in values or pair.group(2) in slots):
            a, b = pair.groups()
            values.pop(a, None)
            slots.pop(a, None)
            if b in values:
                values[a] = list(values[b])
            else:
                slots[a] = slots[b]
        elif op == "punpcklqdq" and pair:
            a, b = values.get(pair.group(1)), values.get(pair.group(2))
            if a and b:
                values[pair.group(1)] = [a[0], b[0]]
            else:
                values.pop(pair.group(1), None)
        elif op in ("movaps", "movups", "movdqa", "movdqu", "mov") and store:
            kind, base, off_text, src = store.groups()
            off = int(off_text or "0", 16)
            if src.startswith("0x"):
                frame[(base, off)] = int(src, 16)
            elif src in values:
                for i, v in enumerate(values[src][: 2 if kind == "XMMWORD" else 1]):
                    frame[(base, off + 8 * i)] = v
        elif "PTR" not in dst:  # any other write to a register forgets what it held
            values.pop(dst, None)
            slots.pop(dst, None)
    return found


def c_bindings(lines: list[str], data: bytes, parser: str) -> dict[str, Any]:
    lists = keyword_lists(lines, data)
    out: dict[str, Any] = {}
    for name, marker in KEYWORD_LISTS.items():
        hits = [(fmt, kws) for fmt, kws in lists if marker in kws]
        if len({(f, tuple(k)) for f, k in hits}) != 1:
            sys.exit(f"the keyword list of {name} was not found once: {hits}")
        fmt, kws = hits[0]
        out[name] = {"format": fmt, "keywords": kws}
    out["_npu_fused_infer_attention_score_out_graph"] = {"python_arg_parser": parser}
    return out


def _schemas_module() -> Any:
    path = Path(__file__).with_name("extract_npu_schemas.py")
    spec = importlib.util.spec_from_file_location("extract_npu_schemas", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(wheel_path: str) -> None:
    schemas_of = _schemas_module()
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel_path) as wheel:
        python = python_signatures(wheel)
        texts: list[str] = []
        lines: list[str] = []
        data = b""
        for member in schemas_of.LIBRARIES:
            path = Path(tmp) / Path(member).name
            path.write_bytes(wheel.read(member))
            texts += schemas_of.plain_strings(path.read_bytes())
            texts += schemas_of.stack_built_strings(path)
            if member.endswith("libtorch_npu.so"):
                data = path.read_bytes()
                lines = subprocess.run(
                    ["objdump", "-d", "--no-show-raw-insn", "-M", "intel", str(path)],
                    capture_output=True, text=True, check=True,
                ).stdout.splitlines()  # fmt: skip
    schemas, parser = schemas_of.schemas_and_parser(texts, wheel_path)
    snapshot = {
        "wheel": Path(wheel_path).name,
        "python": python,
        "c_bindings": c_bindings(lines, data, parser),
        "schemas": schemas,
    }
    json.dump(snapshot, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
