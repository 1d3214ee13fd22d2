"""The architecture's rules, computed from the code: no import cycles among kvlab's modules, every package
folder installed under the one `kvlab` name, and `common` reaching backends only through the registry."""
from __future__ import annotations

import ast
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TOP = {"kvlab": "kvlab", "common": "kvlab.common", "vmm": "kvlab.vmm", "paged": "kvlab.paged",
       "experiments": "kvlab.experiments"}
BACKEND_PACKAGES = ("kvlab.vmm", "kvlab.paged", "kvlab.common.reserve")


def project_modules() -> dict[str, Path]:
    mods = {}
    for folder, name in TOP.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = [p for p in f.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([name, *parts])] = f
    return mods


def runtime_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `path` imports when it runs: module level and inside functions, not under
    `if TYPE_CHECKING:`; `from pkg import name` counts as pkg.name when that is a module."""
    tree = ast.parse(path.read_text())
    hidden = {id(n) for node in ast.walk(tree)
              if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
              for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: runtime_imports(f, modules) - {m} for m, f in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_is_computed_from_the_code():
    graph = import_graph()
    assert "kvlab.common.kv.seam" in graph["kvlab.common.engine"] or any(
        "kvlab.common.kv" in m for m in graph["kvlab.common.engine"])
    assert len(graph) > 50


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_common_imports_no_backend():
    """common finds backends only through the registry (by module name, lazily), never by import."""
    graph = import_graph()
    for module, imports in graph.items():
        if module.startswith("kvlab.common.") and not module.startswith("kvlab.common.reserve"):
            bad = sorted(i for i in imports if i.startswith(BACKEND_PACKAGES))
            assert not bad, f"{module} imports backend modules {bad}"


def test_every_package_folder_is_installed_under_kvlab():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    folders = {name for name, path in project_modules().items() if path.name == "__init__.py"}
    assert folders <= listed, f"package folders missing from pyproject's packages: {sorted(folders - listed)}"
    assert all(p == "kvlab" or p.startswith("kvlab.") for p in listed)
