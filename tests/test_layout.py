"""The package layout by process role, checked on the source with ast.

- no import cycle among graphlane modules (imports run when a module is loaded:
  those at module level, outside functions; imports under ``if TYPE_CHECKING:``
  are for type checkers only and do not count);
- graphlane.sim (the simulated NPU) imports nothing of the worker, the daemon,
  the client or the tools, and imports only at module top (no imports inside
  functions, none after the first statement);
- the tools (graphlane.loadtest, graphlane.bench, graphlane.demo,
  graphlane.example: what drives a daemon or the sim from outside) also import
  graphlane modules only at module top, so that no import inside a function hides a
  cycle among them; nothing of the product imports them;
- graphlane.client and graphlane.protocol (what schedulers import) import nothing
  of workers, orchestrator, sim or tools;
- graphlane.orchestrator (the daemon) imports nothing of graphlane.sim or the
  tools, graphlane.workers nothing of the tools;

The direction rules count every import, also those inside functions and under
TYPE_CHECKING. An edge goes to the module named: ``import a.b`` and
``from a import b`` (b a module) go to a.b, ``from a import name`` goes to a;
the parent packages that Python also initialises are not edges, since a package
importing its own submodules is not a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "graphlane"

#: what drives a daemon or the sim from outside
TOOLS = ("graphlane.loadtest", "graphlane.bench", "graphlane.demo", "graphlane.example")
#: package -> packages it must not import (any import, anywhere in the module)
FORBIDDEN = {
    "graphlane.sim": ("graphlane.workers", "graphlane.orchestrator", "graphlane.client",
                      *TOOLS),
    "graphlane.client": ("graphlane.workers", "graphlane.orchestrator", "graphlane.sim",
                         *TOOLS),
    "graphlane.protocol": ("graphlane.workers", "graphlane.orchestrator", "graphlane.sim",
                           *TOOLS),
    "graphlane.orchestrator": ("graphlane.sim", *TOOLS),
    "graphlane.workers": TOOLS,
}  # fmt: skip
#: packages whose modules import graphlane modules only at module top
TOP_IMPORTS_ONLY = ("graphlane.sim", *TOOLS)


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    in_function: bool
    type_checking: bool
    after_code: bool  # a module-level import below the first statement that is not one

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def sources(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """Module name -> (source, is a package), for every module under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        out[name] = (path.read_text(), is_package)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_preamble(node: ast.stmt) -> bool:
    """Statements that may precede imports: the docstring and TYPE_CHECKING blocks."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return isinstance(node.value.value, str)
    return isinstance(node, ast.If) and _is_type_checking(node.test)


def imports_of(
    name: str, source: str, is_package: bool, modules: Iterable[str]
) -> list[Import]:
    """The graphlane imports of one module."""
    known = set(modules)
    package = name if is_package else name.rpartition(".")[0]
    found: list[Import] = []

    def add(node: ast.stmt, target: str, in_function: bool, tc: bool, after: bool) -> None:
        if target == "graphlane" or target.startswith("graphlane."):
            found.append(Import(name, target, node.lineno, in_function, tc, after))

    def visit(nodes: list[ast.stmt], in_function: bool, tc: bool, top: bool) -> None:
        code_seen = False
        for node in nodes:
            after = top and code_seen
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(node, alias.name, in_function, tc, after)
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    add(node, sub if sub in known else base, in_function, tc, after)
                continue
            if top and not _is_preamble(node):
                code_seen = True
            function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for field_name in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field_name, None) or []
                guarded = isinstance(node, ast.If) and _is_type_checking(node.test)
                inner_tc = tc or (guarded and field_name == "body")
                stmts: list[ast.stmt] = []
                for child in children:
                    stmts += child.body if isinstance(child, ast.ExceptHandler) else [child]
                visit(stmts, function, inner_tc, False)

    visit(ast.parse(source).body, False, False, True)
    return found


def all_imports(modules: Mapping[str, tuple[str, bool]]) -> list[Import]:
    return [
        imp for name, (src, pkg) in modules.items() for imp in imports_of(name, src, pkg, modules)
    ]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def find_cycle(imports: Iterable[Import]) -> list[str] | None:
    """A cycle of load-time imports, as the list of modules around it, or None."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if not imp.in_function and not imp.type_checking and imp.source != imp.target:
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
        for package, forbidden in FORBIDDEN.items():
            if _within(imp.source, package) and any(_within(imp.target, f) for f in forbidden):
                out.append(f"{imp} ({package} must not import {', '.join(forbidden)})")
    return out


def placement_violations(imports: Iterable[Import]) -> list[str]:
    out = []
    for imp in imports:
        if any(_within(imp.source, p) for p in TOP_IMPORTS_ONLY):
            if imp.in_function:
                out.append(f"{imp} inside a function")
            elif imp.after_code:
                out.append(f"{imp} after the module's first statement")
    return out


# ---------------------------------------------------------------- the package
@pytest.fixture(scope="module")
def imports() -> list[Import]:
    modules = sources()
    assert "graphlane.sim.torch_npu" in modules and "graphlane.client" in modules
    return all_imports(modules)


def test_no_import_cycle_among_graphlane_modules(imports: list[Import]) -> None:
    cycle = find_cycle(imports)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_each_process_role_imports_only_what_it_may(imports: list[Import]) -> None:
    assert direction_violations(imports) == []


def test_the_sim_imports_only_at_module_top(imports: list[Import]) -> None:
    assert placement_violations(imports) == []


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
            "graphlane.sim.__init__": "from .a import x\n",
            "graphlane.sim.a": "from . import b\nx = 1\n",
            "graphlane.sim.b": (
                "import graphlane.sim.a\n"
                "def f():\n    from graphlane.workers import engine\n"
                "y = 2\nfrom graphlane.sim import a\n"
            ),
            "graphlane.workers.__init__": "",
            "graphlane.workers.engine": "",
            "graphlane.client.__init__": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from graphlane.loadtest import t\n",
            "graphlane.loadtest.__init__": "",
            "graphlane.loadtest.t": "",
            "graphlane.orchestrator.__init__": "try:\n    import graphlane.sim\n"
            "except ImportError:\n    pass\n",
        }
    )
    assert find_cycle(imports) == ["graphlane.sim.a", "graphlane.sim.b", "graphlane.sim.a"]
    directions = direction_violations(imports)
    assert any("graphlane.sim.b:3 imports graphlane.workers.engine" in v for v in directions)
    assert any("graphlane.client:3 imports graphlane.loadtest.t" in v for v in directions)
    assert any("graphlane.orchestrator:2 imports graphlane.sim" in v for v in directions)
    assert placement_violations(imports) == [
        "graphlane.sim.b:3 imports graphlane.workers.engine inside a function",
        "graphlane.sim.b:5 imports graphlane.sim.a after the module's first statement",
    ]


def test_type_checking_imports_do_not_make_a_cycle() -> None:
    imports = _fake(
        {
            "graphlane.x": "from graphlane import y\n",
            "graphlane.y": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from graphlane import x\n",
        }
    )
    assert find_cycle(imports) is None
