"""The package layout by process role, checked on the source with ast.

Which graphlane package may import which (every import counts: at module level,
inside functions, under TYPE_CHECKING), read from what each one is:

- graphlane.protocol, the wire both sides share, imports nothing of graphlane but
  itself and graphlane.logs;
- graphlane.client (what schedulers import) imports the protocol and logs only;
- graphlane.workers (a device's process) imports the protocol, logs and the sim (its
  sim backend), never the daemon, the client or the tools;
- graphlane.orchestrator (the daemon) imports the protocol, logs, the root package
  (its version) and graphlane.workers (it spawns workers: their spec and entry
  point), never the client, the sim or the tools; workers never import it back;
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = (REPO / "graphlane", REPO / "sim" / "src" / "npusim")
OURS = ("graphlane", "npusim")

#: package -> the graphlane packages it may import (besides itself); "graphlane" alone is
#: the root package (its __init__), not everything under it
ALLOWED = {
    "graphlane.protocol": ("graphlane.logs",),
    "graphlane.client": ("graphlane.protocol", "graphlane.logs"),
    "graphlane.workers": ("graphlane.protocol", "graphlane.logs", "npusim"),
    "graphlane.orchestrator": ("graphlane.protocol", "graphlane.logs", "graphlane.workers",
                               "graphlane"),
    "npusim": (),
}  # fmt: skip


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
    return out


# ---------------------------------------------------------------- the package
@pytest.fixture(scope="module")
def imports() -> list[Import]:
    modules = sources()
    assert "npusim.torch_npu" in modules and "graphlane.client" in modules
    return all_imports(modules)


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
