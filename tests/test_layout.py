"""The package layout by process role, checked on the source with ast.

Which graphlane package may import which (every import counts: at module level,
inside functions, under TYPE_CHECKING), read from what each one is:

- graphlane.protocol, the wire both sides share, imports nothing of graphlane but
  itself and graphlane.logs;
- graphlane.client (what schedulers import) imports the protocol and logs only;
- graphlane.workers (a device's process) imports the protocol, logs, the sim (its
  sim backend) and what it shares with the tools (graphlane.hf_model, a model's
  architecture; graphlane.program_config), never the daemon, the client or the tools;
- graphlane.orchestrator (the daemon) imports the protocol, logs, the root package
  (its version) and of graphlane.workers only its torch-free spec and entry point
  (graphlane.workers.spec, .entry, .process_group's GroupSpec) and the two helpers it
  shares (affinity, memory), never the client, the sim, the tools, or a program: the
  daemon imports no torch (a worker builds its programs; test_the_daemon_imports_no_torch
  runs it); workers never import it back;
- graphlane.loadtest (a client of the daemon) imports nothing of graphlane.workers;
- graphlane.bench and benchmarks/ use npusim's public API only: what npusim's
  ``__init__`` exports (and its torch_npu namespace), never its modules' insides nor its
  classes by name;
- npusim (the simulated NPU, a distribution of its own under sim/) imports nothing of
  graphlane.

No import cycle among the modules of graphlane and npusim: an edge for every import,
wherever it is (a function-level import still ties the two modules together, and one
under TYPE_CHECKING ties their types; a lower module names what it needs of a higher
one by a Protocol of its own). The tools (graphlane.loadtest, graphlane.bench, the
demo, the command line) may import any of graphlane; nothing above
imports them.

An edge goes to the module named: ``import a.b`` and ``from a import b`` (b a module)
go to a.b, ``from a import name`` goes to a; the parent packages that Python also
initialises are not edges, since a package importing its own submodules is not a
cycle.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = (REPO / "graphlane", REPO / "sim" / "src" / "npusim")
OURS = ("graphlane", "npusim")

#: what the daemon may import of the workers: their spec and entry point, and two helpers
TORCH_FREE_WORKERS = ("graphlane.workers.spec", "graphlane.workers.entry",
                      "graphlane.workers.process_group",  # a group rank's spec (its torch: lazy)
                      "graphlane.workers.affinity", "graphlane.workers.memory")  # fmt: skip
#: package -> the graphlane packages it may import (besides itself); "graphlane" alone is
#: the root package (its __init__), not everything under it
ALLOWED = {
    "graphlane.protocol": ("graphlane.logs",),
    "graphlane.client": ("graphlane.protocol", "graphlane.logs"),
    "graphlane.workers": ("graphlane.protocol", "graphlane.logs", "npusim",
                          "graphlane.hf_model", "graphlane.program_config"),
    "graphlane.orchestrator": ("graphlane.protocol", "graphlane.logs", "graphlane",
                               *TORCH_FREE_WORKERS),
    "graphlane.hf_model": ("graphlane.program_config",),
    "graphlane.program_config": (),
    "npusim": (),
}  # fmt: skip
#: package -> the graphlane packages it may not import (it may import the rest)
FORBIDDEN = {"graphlane.loadtest": ("graphlane.workers",)}
#: what of npusim the tools that measure it may import: its package (the names its
#: __init__ exports) and its torch_npu namespace
NPUSIM_PUBLIC = ("npusim", "npusim.torch_npu")
TOOLS = ("graphlane.bench", "benchmarks")


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    in_function: bool
    type_checking: bool

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def sources(roots: Iterable[Path] = ROOTS) -> dict[str, tuple[str, bool]]:
    """Module name -> (source, is a package), for every module under ``root``."""
    out = {}
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        root = next(r for r in roots if r in path.parents)
        parts = path.relative_to(root.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        out[name] = (path.read_text(), is_package)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(
    name: str, source: str, is_package: bool, modules: Iterable[str]
) -> list[Import]:
    """The graphlane imports of one module."""
    known = set(modules)
    package = name if is_package else name.rpartition(".")[0]
    found: list[Import] = []

    def add(node: ast.stmt, target: str, in_function: bool, tc: bool) -> None:
        if any(target == ours or target.startswith(ours + ".") for ours in OURS):
            found.append(Import(name, target, node.lineno, in_function, tc))

    def visit(nodes: list[ast.stmt], in_function: bool, tc: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(node, alias.name, in_function, tc)
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    add(node, sub if sub in known else base, in_function, tc)
                continue
            function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for field_name in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field_name, None) or []
                guarded = isinstance(node, ast.If) and _is_type_checking(node.test)
                inner_tc = tc or (guarded and field_name == "body")
                stmts: list[ast.stmt] = []
                for child in children:
                    stmts += child.body if isinstance(child, ast.ExceptHandler) else [child]
                visit(stmts, function, inner_tc)

    visit(ast.parse(source).body, False, False)
    return found


def all_imports(modules: Mapping[str, tuple[str, bool]]) -> list[Import]:
    return [
        imp for name, (src, pkg) in modules.items() for imp in imports_of(name, src, pkg, modules)
    ]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def find_cycle(imports: Iterable[Import]) -> list[str] | None:
    """A cycle of imports (of every kind), as the list of modules around it, or None."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.source != imp.target:
            graph.setdefault(imp.source, set()).add(imp.target)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := dfs(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)) is not None:
            return cycle
    return None


def direction_violations(imports: Iterable[Import]) -> list[str]:
    out = []
    for imp in imports:
        for package, allowed in ALLOWED.items():
            if not _within(imp.source, package) or _within(imp.target, package):
                continue
            if not any(imp.target == a if a == "graphlane" else _within(imp.target, a)
                       for a in allowed):  # fmt: skip
                may = ", ".join(allowed) or "nothing of graphlane"
                out.append(f"{imp} ({package} may import {may})")
        for package, forbidden in FORBIDDEN.items():
            if _within(imp.source, package) and any(_within(imp.target, f) for f in forbidden):
                out.append(f"{imp} ({package} may not import {', '.join(forbidden)})")
        if (
            any(_within(imp.source, t) for t in TOOLS)
            and _within(imp.target, "npusim")
            and imp.target not in NPUSIM_PUBLIC
        ):
            out.append(f"{imp} (npusim's public API only: {', '.join(NPUSIM_PUBLIC)})")
    return out


# ---------------------------------------------------------------- the package
def _tool_sources() -> dict[str, tuple[str, bool]]:
    """The modules of graphlane, npusim and benchmarks/ (a directory of scripts)."""
    return {**sources(), **sources((REPO / "benchmarks",))}


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    modules = _tool_sources()
    assert "npusim.torch_npu" in modules and "graphlane.client" in modules
    assert "benchmarks.sim_ops" in modules
    return all_imports(modules)


def _imported_in_a_fresh_process(code: str) -> set[str]:
    """The modules ``sys.modules`` holds after ``code`` runs in a new interpreter."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=REPO, check=True)  # fmt: skip
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_the_daemon_imports_no_torch_even_to_read_a_models_config() -> None:
    """The daemon's process (the command line with every command's flags, the daemon,
    its config, with a model program that names a directory that does not exist: the
    worker reads it) loads no torch, no program and no model."""
    loaded = _imported_in_a_fresh_process(
        "import graphlane.cli, graphlane.orchestrator.daemon, graphlane.orchestrator.metrics\n"
        "graphlane.cli._parser().parse_args(['serve'])\n"
        "from graphlane.orchestrator import config\n"
        "config.from_mapping({'programs': [{'name': 'model', 'model': '/nonexistent'}]})"
    )
    assert "torch" not in loaded and "numpy" in loaded
    workers = {m for m in loaded if m.startswith("graphlane.workers.")}
    assert workers <= set(TORCH_FREE_WORKERS), workers


def test_the_load_test_imports_nothing_of_the_workers() -> None:
    loaded = _imported_in_a_fresh_process(
        "import graphlane.loadtest, graphlane.loadtest.cli, graphlane.loadtest.driver, "
        "graphlane.loadtest.generation, graphlane.loadtest.serving"
    )
    assert not {m for m in loaded if m.startswith("graphlane.workers")}


def test_the_load_tests_attention_shape_is_the_programs_config() -> None:
    """The load test reads the attention program's shape itself (it imports no worker
    code): the same keys and defaults as the program's config."""
    from graphlane.loadtest.attention import AttentionShape
    from graphlane.workers.programs.attention import AttentionConfig

    assert AttentionShape().__dict__ == AttentionConfig().__dict__


def test_the_tools_name_no_class_of_npusim_but_its_public_ones() -> None:
    """graphlane.bench and benchmarks/ never compare a type's name with one of npusim's
    own classes (what ``type(node).__name__ == "ExtWaitWork"`` did): its insides may
    change; what the tools need of them is in its public API (graph_profile)."""
    import npusim

    modules = _tool_sources()
    private = {
        node.name
        for name, (src, _) in modules.items() if _within(name, "npusim")
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.ClassDef) and node.name[0].isupper()
    } - set(npusim.__all__)  # fmt: skip
    named = [
        f"{name}:{node.lineno} names {node.value!r}"
        for name, (src, _) in modules.items() if any(_within(name, t) for t in TOOLS)
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.Constant) and node.value in private
    ]  # fmt: skip
    assert named == []


def test_no_import_cycle_among_graphlane_and_npusim_modules(imports: list[Import]) -> None:
    cycle = find_cycle(imports)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_each_process_role_imports_only_what_it_may(imports: list[Import]) -> None:
    assert direction_violations(imports) == []


def test_one_reference_scheduler_on_the_client_side(imports: list[Import]) -> None:
    """The continuous-batching scheduler of a model is the client's (issue 41): the load
    test and the demo run graphlane.client.scheduler, and no other module defines one."""
    users = {imp.source for imp in imports if imp.target == "graphlane.client.scheduler"}
    assert {"graphlane.loadtest.serving", "graphlane.demo_model"} <= users
    defining = [
        name for name, (src, _) in sources().items()
        if "class GenerationLoop" in src and name != "graphlane.client.scheduler"
    ]  # fmt: skip
    assert defining == []


# ---------------------------------------------------------------- the checker itself
def _fake(files: dict[str, str]) -> list[Import]:
    modules = {
        name.removesuffix(".__init__"): (src, name.endswith(".__init__"))
        for name, src in files.items()
    }
    return all_imports(modules)


def test_the_checker_sees_each_kind_of_violation() -> None:
    imports = _fake(
        {
            "graphlane.__init__": "",
            "npusim.__init__": "from .a import x\n",
            "npusim.a": "from . import b\nx = 1\n",
            "npusim.b": (
                "import npusim.a\n"
                "def f():\n    from graphlane.workers import engine\n"
                "y = 2\nfrom npusim import a\n"
            ),
            "graphlane.workers.__init__": "",
            "graphlane.workers.engine": "",
            "graphlane.client.__init__": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from graphlane.loadtest import t\n",
            "graphlane.loadtest.__init__": "",
            "graphlane.loadtest.t": "",
            "graphlane.orchestrator.__init__": "try:\n    import npusim\n"
            "except ImportError:\n    pass\n",
        }
    )
    assert find_cycle(imports) == ["npusim.a", "npusim.b", "npusim.a"]
    directions = direction_violations(imports)
    assert any("npusim.b:3 imports graphlane.workers.engine" in v for v in directions)
    assert any("graphlane.client:3 imports graphlane.loadtest.t" in v for v in directions)
    assert any("graphlane.orchestrator:2 imports npusim" in v for v in directions)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("graphlane.protocol.wire", "graphlane.client.transport"),
        ("graphlane.protocol.wire", "graphlane.workers.loop"),
        ("graphlane.client.transport", "graphlane.workers.loop"),
        ("graphlane.client.transport", "graphlane.orchestrator.daemon"),
        ("graphlane.workers.loop", "graphlane.orchestrator.daemon"),
        ("graphlane.workers.loop", "graphlane.client.transport"),
        ("graphlane.workers.loop", "graphlane.loadtest.t"),
        ("graphlane.orchestrator.daemon", "graphlane.client.transport"),
        ("graphlane.orchestrator.daemon", "npusim.a"),
        ("graphlane.orchestrator.daemon", "graphlane.loadtest.t"),
        ("npusim.a", "graphlane.protocol.wire"),
    ],
)
def test_each_direction_rule_sees_its_violation(source: str, target: str) -> None:
    modules = ["graphlane.protocol.wire", "graphlane.client.transport", "graphlane.workers.loop",
               "graphlane.orchestrator.daemon", "npusim.a", "graphlane.loadtest.t"]  # fmt: skip
    package, _, name = target.rpartition(".")
    files = {m: "" for m in modules}
    files[source] = f"def f():\n    from {package} import {name}\n"
    assert [v.split(" (")[0] for v in direction_violations(_fake(files))] == [
        f"{source}:2 imports {target}"
    ]


@pytest.mark.parametrize("package", ["graphlane", "npusim"])
@pytest.mark.parametrize(
    "second",
    [
        "def f():\n    from {p} import x\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {p} import x\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    pass\nelse:\n"
        "    from {p}.x import X\n",
    ],
)
def test_function_level_and_type_checking_imports_make_a_cycle(package: str, second: str) -> None:
    p = package
    imports = _fake({f"{p}.__init__": "", f"{p}.x": f"from {p} import y\n",
                     f"{p}.y": second.format(p=p)})  # fmt: skip
    assert find_cycle(imports) == [f"{p}.x", f"{p}.y", f"{p}.x"]
