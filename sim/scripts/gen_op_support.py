# ruff: noqa: RUF001, RUF003  (the docs it parses use full-width punctuation)
"""Generate npusim's op-support table for torch_npu 2.14 on an Atlas A2 (910B).

    python sim/scripts/gen_op_support.py \\
        --wheel /path/to/unpacked/torch_npu \\
        --op-plugin /path/to/Ascend/op-plugin.git --op-plugin-ref master \\
        --cann-ops /path/to/hicann/ops-math.git --cann-ops /path/to/hicann/ops-nn.git \\
        --cann-ops /path/to/hicann/ops-transformer.git \\
        --out sim/src/npusim/data/op_support_torch_npu_2.14.0.json

Git sources are read with ``git`` (bare mirrors are fine); nothing is checked out.
For every aten op the sim serves (:func:`npusim.tensor.backend_op_names`) and every
``torch.ops.npu`` op it registers, the table says how torch_npu 2.14 runs it:

- ``path``: ``aclnn`` (op-plugin has an op_api implementation for v2.14: an aclnn
  kernel, allowed in a graph capture), ``aclop`` (only an acl_op implementation:
  refused in a capture), ``framework`` (torch_npu's own C++: copies, allocation,
  views), ``atb`` (an ATB operation) or ``unknown`` (no registration found);
- ``kernels``: the aclnn kernels its op_api implementation launches (EXEC_NPU_CMD);
- ``unit``: where the kernel runs on an A2, from CANN's ops sources: ``aicore``,
  ``aicpu`` (every launch of its l0 op is an AI CPU task, or the AI Core one is only
  for another SoC), ``aicore_or_aicpu`` (chosen by dtype or shape: not decided
  here) or ``unknown`` (its source is not in the CANN repos given);
- for documented fused ops, ``arguments``: per tensor argument the dtypes allowed on
  an A2, whether it must be contiguous and its formats, parsed from the wheel's
  ``_op_plugin_docs.py`` (or ``op_plugin/atb/_atb_api_docs.py``).

Where a source does not say, the entry says ``unknown``; nothing is filled in by hand
but :data:`SHARED_DOCS` (an undocumented op that runs the same operation as a
documented one, both named with the source that shows it).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

TORCH_NPU_VERSION = "v2.14"
# More aclnn kernels than this under one op's functions: the call walk went astray
# (a generic helper name); its kernels are recorded as unknown (an empty list).
MAX_KERNELS = 6

# op -> (documented op whose argument rules it shares, why)
SHARED_DOCS = {
    "_npu_paged_attention": (
        "_npu_paged_attention_v2",
        "both run ATB's PagedAttentionOperation (op-plugin op_plugin/ops/atb/"
        "PagedAttentionAtb.cpp and PagedAttentionAtbV2.cpp)",
    ),
}


DTYPE_WORDS = {
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "int4(int32)": "int4(int32)",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "float8_e5m2": "float8_e5m2",
    "float8_e4m3fn": "float8_e4m3fn",
    "hifloat8": "hifloat8",
    "bool": "bool",
}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "--git-dir", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


def commit_of(repo: Path, ref: str) -> str:
    return git(repo, "rev-parse", f"{ref}^{{commit}}").strip()


# ------------------------------------------------------------------ op-plugin
def in_version(spec: Any, version: str) -> bool:
    """Whether an op_plugin_functions.yaml version spec covers ``version``."""
    if spec is None:
        return False
    if spec == "all_version":
        return True

    def num(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.strip().lstrip("v").split("."))

    if isinstance(spec, list):
        lo, hi = (str(s).strip() for s in spec)
        return num(lo) <= num(version) and (hi == "newest" or num(version) <= num(hi))
    return version in [s.strip() for s in str(spec).split(",")]


def op_plugin_entries(repo: Path, ref: str) -> dict[str, list[dict[str, Any]]]:
    """op name ("add.Tensor") -> its op_plugin_functions.yaml entries (an op may be
    listed in more than one section: ``zeros`` in official and in symint)."""
    data = yaml.safe_load(git(repo, "show", f"{ref}:op_plugin/config/op_plugin_functions.yaml"))
    out: dict[str, list[dict[str, Any]]] = {}
    for section in ("official", "custom", "symint", "quant", "autograd"):
        for e in data.get(section) or []:
            if isinstance(e, dict) and "func" in e:
                out.setdefault(e["func"].split("(")[0].strip(), []).append(e)
    return out


_DEF = re.compile(r"^(?:[A-Za-z_:<>,\s&*]+?)\b(\w+)\s*\(", re.M)
_EXEC = re.compile(r"EXEC_\w*CMD\w*\(\s*(aclnn\w+)")
_CALL = re.compile(r"\b(op_api::)?(\w+)\s*\(")


def opapi_functions(repo: Path, ref: str) -> dict[str, dict[str, set[str]]]:
    """C++ function name in op_plugin/ops/opapi -> {"kernels": aclnn names it
    launches, "calls": op_api functions it calls}, over all its overloads."""
    funcs: dict[str, dict[str, set[str]]] = {}
    names = git(repo, "ls-tree", "-r", "--name-only", ref, "op_plugin/ops/opapi/").split()
    for path in names:
        if not path.endswith(".cpp"):
            continue
        text = git(repo, "show", f"{ref}:{path}")
        starts = [
            (m.start(), m.group(1))
            for m in _DEF.finditer(text)
            if not m.group(0).lstrip().startswith(("return", "if", "else", "for", "while"))
            and m.group(0)[:1] not in (" ", "\t", "#", "}")
        ]
        local = {name for _, name in starts}
        for i, (at, name) in enumerate(starts):
            body = text[at : starts[i + 1][0] if i + 1 < len(starts) else len(text)]
            f = funcs.setdefault(name, {"kernels": set(), "calls": set()})
            f["kernels"].update(_EXEC.findall(body))
            # calls of op_api functions, or of helpers defined in the same file
            f["calls"].update(
                c for ns, c in _CALL.findall(body) if c != name and (ns or c in local)
            )
    return funcs


def kernels_of(name: str, funcs: dict[str, dict[str, set[str]]], depth: int = 2) -> set[str]:
    """The aclnn kernels function ``name`` launches, itself or through the op-plugin
    functions it calls (``depth`` calls deep)."""
    f = funcs.get(name)
    if f is None:
        return set()
    out = set(f["kernels"])
    if depth:
        for c in f["calls"]:
            if c in funcs:
                out |= kernels_of(c, funcs, depth - 1)
    return out


def cpp_names(op: str) -> list[str]:
    """The op-plugin C++ functions that may implement aten/npu op ``op``."""
    base, _, overload = op.partition(".")
    names = [base]
    if "out" in overload.split("_"):
        names.insert(0, base + "_out")
    return [n for name in names for n in (name, name + "_symint")]


# ------------------------------------------------------------------ CANN ops
_WORKSPACE = re.compile(r"\b(aclnn\w+)GetWorkspaceSize\s*\(")
_REGISTER = re.compile(r"OP_TYPE_REGISTER\((\w+)\)")
# The branch an A2 (not the regbase arch DAV_3510 / ASCEND910_95) takes, when the
# l0 op chooses between its AI Core and AI CPU launches by SoC: the function it calls.
_A2_BRANCH = re.compile(
    r"if\s*\(\s*(?:!\s*IsRegBase\(\)|\w+\s*!=\s*SocVersion::ASCEND910_95)\s*\)\s*\{?\s*"
    r"return\s+(\w+)\s*\("
)


class CannOps:
    """What CANN's ops sources say of where kernels run.

    ``l0``: l0 op name -> {"units": its launch kinds, "a2": the function the
    non-regbase branch calls, "source"}. ``docs``: aclnn kernel name -> (repo, ref, the
    op's directory, its files), from ``<op>/docs/aclnnXxx.md``: for a fused op whose
    aclnn API launches its kernel without an l0 launcher (FusedInferAttentionScore),
    the op's definition says the unit (``AICore()`` in ``op_host/*_def.cpp``, an
    ``op_kernel_aicpu`` directory).
    """

    def __init__(self, repos: list[tuple[Path, str]]) -> None:
        self.l0: dict[str, dict[str, Any]] = {}
        self.docs: dict[str, tuple[Path, str, str, list[str]]] = {}
        for repo, ref in repos:
            files = [
                f for f in git(repo, "ls-tree", "-r", "--name-only", ref).split()
                if not f.startswith("experimental/") and "/tests/" not in f
            ]  # fmt: skip
            by_dir: dict[str, list[str]] = {}
            for path in files:
                parts = path.split("/")
                if len(parts) > 3:
                    by_dir.setdefault("/".join(parts[:2]), []).append(path)
            for path in files:
                name = Path(path).name
                parts = path.split("/")
                if len(parts) > 3 and parts[2] == "docs" and name.startswith("aclnn"):
                    op_dir = "/".join(parts[:2])
                    self.docs.setdefault(name.removesuffix(".md"),
                                         (repo, ref, op_dir, by_dir.get(op_dir, [])))  # fmt: skip
                if "/op_api/" not in path or not path.endswith(".cpp") or name.startswith("aclnn_"):
                    continue
                text = git(repo, "show", f"{ref}:{path}")
                units = set()
                if "ADD_TO_LAUNCHER_LIST_AICORE" in text:
                    units.add("aicore")
                if "ADD_TO_LAUNCHER_LIST_AICPU" in text:
                    units.add("aicpu")
                if not units:
                    continue
                for op in _REGISTER.findall(text):
                    self.l0.setdefault(op, {"units": units, "a2": _A2_BRANCH.findall(text),
                                            "source": f"{repo_name(repo)}:{path}"})  # fmt: skip

    def unit(self, kernel: str) -> tuple[str, str]:
        """(unit, source) of aclnn ``kernel`` on an A2."""
        name = kernel.removeprefix("aclnn").removeprefix("Inplace")
        e = self.l0.get(name)
        if e is not None:
            units, a2 = e["units"], e["a2"]
            if len(units) == 1:
                return next(iter(units)), e["source"]
            # both: the one the non-regbase branch calls, when the source says by name
            if len(a2) == 1 and ("AiCpu" in a2[0]) != ("AiCore" in a2[0]):
                return ("aicpu" if "AiCpu" in a2[0] else "aicore"), e["source"]
            return "aicore_or_aicpu", e["source"]
        # a versioned API (aclnnXxxV5) belongs to the op of its family's documentation
        d = self.docs.get(kernel) or self.docs.get(re.sub(r"V\d+$", "", kernel))
        if d is None:
            return "unknown", ""
        repo, ref, op_dir, files = d
        units = set()
        if any("/op_kernel_aicpu/" in f for f in files):
            units.add("aicpu")
        defs = [f for f in files if "/op_host/" in f and f.endswith("_def.cpp")]
        if any("AICore()" in git(repo, "show", f"{ref}:{f}") for f in defs):
            units.add("aicore")
        if len(units) != 1:
            return ("aicore_or_aicpu" if units else "unknown"), f"{repo_name(repo)}:{op_dir}"
        return next(iter(units)), f"{repo_name(repo)}:{op_dir}"


def repo_name(repo: Path) -> str:
    return repo.parent.name.replace("+", "/") if repo.name == "repo" else repo.name


# ------------------------------------------------------------------ docs
_DOC_CALL = re.compile(r'_add_torch_npu(?:_atb)?_docstr\(\s*"(\w+)",\s*"""(.*?)"""', re.S)


def docs(wheel: Path) -> dict[str, tuple[str, str]]:
    """op -> (its documentation text, file)."""
    out = {}
    for rel in ("_op_plugin_docs.py", "op_plugin/atb/_atb_api_docs.py"):
        text = (wheel / rel).read_text(encoding="utf-8")
        for m in _DOC_CALL.finditer(text):
            out.setdefault(m.group(1), (m.group(2), rel))
    return out


_WORD = r"(?:torch\.)?[A-Za-z][A-Za-z0-9_()]*"
_DTYPE_LIST = re.compile(
    rf"(?:数据类型支持|数据类型为|数据类型|dtype支持|支持)[:：]?\s*"
    rf"({_WORD}(?:\s*(?:、|/|,|，|和|或)\s*{_WORD})*)"
)
# Where a parameter's description ends: the sections after the parameters.
_SECTIONS = ("输出说明", "约束说明", "支持的型号", "调用示例", "示例", "支持版本", "规格约束")
# "name:", "name (Tensor):", "name(torch.Tensor):", "-   name（Tensor）：", "“x”："
_PARAM = re.compile(r"^[-*\s]*[“\"]?(\w+)[”\"]?\s*(?:[（(][^)）]*[)）])?\s*[:：]")


def dtypes_in(text: str) -> list[str] | None:
    """The dtypes the first dtype list in ``text`` names (None: no list there)."""
    for m in _DTYPE_LIST.finditer(text):
        words = re.split(r"\s*(?:、|/|,|，|和|或)\s*", m.group(1))
        found = [DTYPE_WORDS.get(w.lower().removeprefix("torch.")) for w in words]
        known = sorted({d for d in found if d})
        if known:
            return known
    return None


def argument_rules(text: str, tensor_args: list[str]) -> dict[str, Any]:
    """Per tensor argument: dtypes allowed on an A2, contiguity (True: non-contiguous
    tensors are not supported; False: they are; None: not said) and formats."""
    rules: dict[str, Any] = {}
    current = None
    a2 = "Atlas A2"
    start = max(text.find("参数说明"), 0)
    for raw in text[start:].splitlines():
        line = raw.strip()
        if line.startswith(_SECTIONS):
            break
        m = _PARAM.match(line)
        if m and not line.startswith("Atlas"):
            name = m.group(1)
            current = name if name in tensor_args and name not in rules else None
            if current is not None:
                rules[current] = {"dtypes": dtypes_in(line.split(a2)[0]), "contiguous": None,
                                  "formats": None}  # fmt: skip
        if current is None:
            continue
        r = rules[current]
        if a2 in line:  # the A2's own rule wins over the general one
            d = dtypes_in(line.split(":", 1)[-1].split("：", 1)[-1])
            if d:
                r["dtypes"] = d
        if "不支持非连续" in line:
            r["contiguous"] = True
        elif "支持非连续" in line:
            r["contiguous"] = False
        f = re.search(r"(?:数据格式支持|支持)\s*(ND|NZ)(?:格式)?", line)
        if f:
            r["formats"] = sorted(set((r["formats"] or []) + [f.group(1)]))
    return rules


# ------------------------------------------------------------------ table
def served_ops() -> tuple[list[str], dict[str, list[str]]]:
    """(aten ops the sim serves, torch.ops.npu op the sim registers -> its tensor
    arguments but outputs)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import torch
    from npusim import torch_npu  # noqa: F401  (registers the npu ops)
    from npusim.tensor import backend_op_names

    npu: dict[str, list[str]] = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("npu::"):
            continue
        name = qualified.removeprefix("npu::")
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.npu, packet), overload or "default")
        npu[name] = [
            a.name
            for a in op._schema.arguments
            if "Tensor" in str(a.type) and a.name != "out" and not a.is_out
        ]
    return sorted(backend_op_names()), npu


def build(args: argparse.Namespace) -> dict[str, Any]:
    wheel = Path(args.wheel)
    plugin = Path(args.op_plugin)
    cann = [(Path(p), "HEAD") for p in args.cann_ops]
    codegen = yaml.safe_load(
        (wheel / "csrc/aten/npu_native_functions_by_codegen.yaml").read_text(encoding="utf-8")
    )
    impl: dict[str, str | None] = {}
    for section in ("supported", "symint", "quant", "autograd", "custom"):
        for e in codegen.get(section) or []:
            if isinstance(e, str):
                impl.setdefault(e, "framework")
            else:
                impl.setdefault(e["func"].split("(")[0].strip(), e.get("impl_ns"))
    entries = op_plugin_entries(plugin, args.op_plugin_ref)
    atb_yaml = git(plugin, "show", f"{args.op_plugin_ref}:op_plugin/config/atb_ops.yaml")
    atb = {
        str(f["impl_name"]).rpartition("::")[2]
        for f in yaml.safe_load(atb_yaml.lstrip("\ufeff"))["functions"]
    }
    funcs = opapi_functions(plugin, args.op_plugin_ref)
    cann_ops = CannOps(cann)
    aten, npu = served_ops()

    def entry(op: str) -> dict[str, Any]:
        ns = impl.get(op, "absent")
        if ns == "absent":
            return {"path": "unknown"}
        spaces = [s.strip() for s in str(ns).split(",")] if ns else []
        if ns == "framework" or not spaces:
            return {"path": "framework"}
        listed = entries.get(op, [])
        if "op_api" not in spaces or (
            listed and not any(in_version(e.get("op_api"), TORCH_NPU_VERSION) for e in listed)
        ):
            return {"path": "aclop"}
        kernels: set[str] = set()
        gen = next((e["gen_opapi"] for e in listed if e.get("gen_opapi")), {})
        if "structured_inherit" in gen:
            inherited = entries.get(gen["structured_inherit"], [])
            gen = next((e["gen_opapi"] for e in inherited if e.get("gen_opapi")), {})
        exec_ = gen.get("exec")
        if exec_:
            kernels.add(str(exec_).split(",")[0].strip())
        for n in cpp_names(op):
            kernels |= kernels_of(n, funcs)
        if len(kernels) > MAX_KERNELS:  # a helper's name clash, not this op's kernels
            kernels = set()
        out: dict[str, Any] = {"path": "aclnn", "kernels": sorted(kernels)}
        if not kernels:
            out["unit"] = "unknown"
            return out
        units = {k: cann_ops.unit(k) for k in sorted(kernels)}
        kinds = {u for u, _ in units.values()}
        out["unit"] = (
            "aicpu" if kinds == {"aicpu"} else "aicore" if kinds == {"aicore"}
            else "aicore_or_aicpu" if kinds <= {"aicore", "aicpu", "aicore_or_aicpu"}
            else "unknown"
        )  # fmt: skip
        sources = sorted({s for _, s in units.values() if s})
        if sources:
            out["unit_source"] = sources
        return out

    table_aten = {op: entry(op) for op in aten}
    version = (wheel / "version.py").read_text().split("'")
    documented = docs(wheel)
    table_npu: dict[str, Any] = {}
    for name, tensor_args in npu.items():
        base = name.partition(".")[0]
        e = entry(base) if base in impl else {"path": "atb" if base in atb else "unknown"}
        doc_name, why = SHARED_DOCS.get(base, (base, ""))
        doc = documented.get(doc_name)
        if doc is None:
            e["arguments"] = "unknown"
            e["why"] = "no documentation in the wheel"
        else:
            e["arguments"] = argument_rules(doc[0], tensor_args)
            e["documented_in"] = doc[1] + (f" ({doc_name}: {why})" if why else "")
        table_npu[name] = e
    return {
        "about": "How torch_npu 2.14 runs each op npusim serves, on an Atlas A2 (910B); "
        "generated by sim/scripts/gen_op_support.py, see sim/README.md 'What an NPU can run'",
        "paths": {
            "aclnn": "op-plugin has an op_api (aclnn) implementation for v2.14",
            "aclop": "only an acl_op implementation: refused in an NPU graph capture",
            "framework": "torch_npu's own C++ (copies, allocation, views)",
            "atb": "an ATB operation (op_plugin/ops/atb)",
            "unknown": "no NPU registration in the wheel's npu_native_functions yaml",
        },
        "torch_npu": {"version": version[1], "git_version": version[3]},
        "sources": {
            repo_name(plugin): {
                "ref": args.op_plugin_ref,
                "commit": commit_of(plugin, args.op_plugin_ref),
            },
            **{repo_name(p): {"ref": r, "commit": commit_of(p, r)} for p, r in cann},
        },
        "aten": table_aten,
        "npu": table_npu,
    }


def dump(table: dict[str, Any]) -> str:
    """The table as JSON, one line per op (diffs of a regeneration stay readable)."""
    lines = ["{"]
    keys = sorted(table)
    for i, k in enumerate(keys):
        v = table[k]
        end = "," if i + 1 < len(keys) else ""
        if k in ("aten", "npu"):
            ops = sorted(v)
            lines.append(f"{json.dumps(k)}: {{")
            lines += [
                f"  {json.dumps(op)}: {json.dumps(v[op], sort_keys=True)}"
                + ("," if j + 1 < len(ops) else "")
                for j, op in enumerate(ops)
            ]
            lines.append("}" + end)
        else:
            lines.append(f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}{end}")
    return "\n".join([*lines, "}"]) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheel", required=True, help="the unpacked torch_npu package directory")
    p.add_argument("--op-plugin", required=True, help="git dir of Ascend/op-plugin")
    p.add_argument("--op-plugin-ref", default="master")
    p.add_argument("--cann-ops", action="append", default=[], help="git dir of a CANN ops repo")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    table = build(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(dump(table), encoding="utf-8")
    counts: dict[str, int] = {}
    for e in table["aten"].values():
        k = e["path"] + ("/" + e["unit"] if "unit" in e else "")
        counts[k] = counts.get(k, 0) + 1
    print(json.dumps(counts, sort_keys=True))


if __name__ == "__main__":
    main()
