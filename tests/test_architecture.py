"""The architecture's rules, computed from the code: no import cycles among kvlab's modules (not even through
imports made only for type checking), every library folder reachable by path under the one `kvlab` name, and
`common` reaching backends only through the registry."""
from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from backends.slab import SPEC as SLAB

from kvlab.common.config import make_config
from kvlab.common.errors import ConfigError
from kvlab.common.kv.registry import BUILTIN, ENTRY_POINTS, REGISTRY, Registry, load_spec

ROOT = Path(__file__).resolve().parent.parent
LINKED = ("common", "vmm", "paged", "reserve", "experiments")   # top-level names kept for the design: links into kvlab/
BACKEND_PACKAGES = ("kvlab.vmm", "kvlab.paged", "kvlab.reserve", "kvlab.elastic")


def project_modules() -> dict[str, Path]:
    mods = {}
    for f in (ROOT / "kvlab").rglob("*.py"):
        parts = [p for p in f.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
        mods[".".join(parts)] = f
    return mods


def imports_of(path: Path, modules: dict[str, Path], type_checking: bool = False) -> set[str]:
    """Project modules `path` imports: module level and inside functions, and with `type_checking` also those
    under `if TYPE_CHECKING:` (skipped otherwise: they never run); `from pkg import name` counts as pkg.name when
    that is a module."""
    tree = ast.parse(path.read_text())
    hidden = set() if type_checking else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
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


def import_graph(type_checking: bool = False, modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    modules = project_modules() if modules is None else modules
    return {m: imports_of(f, modules, type_checking) - {m} for m, f in modules.items()}


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


def test_no_import_cycles_even_through_type_checking_imports():
    """A type-only import back is still a cycle in the design: shared types go in one module both sides import,
    and a type needed only as a type is a protocol on the side that uses it."""
    assert cycles(import_graph(type_checking=True)) == []


def test_a_cycle_planted_through_a_type_checking_import_is_found(tmp_path):
    (tmp_path / "a.py").write_text("from kvlab.b import B\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvlab.a import A\n")
    modules = {"kvlab.a": tmp_path / "a.py", "kvlab.b": tmp_path / "b.py"}
    assert cycles(import_graph(modules=modules)) == []
    assert cycles(import_graph(type_checking=True, modules=modules)) == [["kvlab.a", "kvlab.b"]]


def test_common_imports_no_backend():
    """common finds backends only through the registry (by module name, lazily), never by import, not even one
    made only for type checking."""
    graph = import_graph(type_checking=True)
    for module, imports in graph.items():
        if module.startswith("kvlab.common."):
            bad = sorted(i for i in imports if i.startswith(BACKEND_PACKAGES))
            assert not bad, f"{module} imports backend modules {bad}"


BACKEND_NAMES = ("vmm", "paged", "reserve", "elastic")
# the one place common names kvlab's own backends: the registry's list of where their specs live
NAMED_ON_PURPOSE = {("kv/registry.py", "BUILTIN")}


def docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def backend_names_in(path: Path, relative: str) -> list[str]:
    """Where the code of one common/ module names a backend: a string naming a backend module ("kvlab.paged...")
    or a comparison of something called backend with a backend's name (`cfg.backend != "vmm"`). Docstrings and
    comments may name backends (they explain); the layout "paged" of the attention code is not a backend."""
    tree = ast.parse(path.read_text())
    skip = docstrings(tree) | {id(n) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                               and any(isinstance(t, ast.Name) and (relative, t.id) in NAMED_ON_PURPOSE
                                       for t in node.targets) for n in ast.walk(node)}
    module = re.compile(rf"kvlab\.({'|'.join(BACKEND_NAMES)})(\.|:|$)")
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and module.match(node.value):
            found.append(f"{relative}:{node.lineno} module path {node.value!r}")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = {n.value for side in sides for n in ast.walk(side)
                     if isinstance(n, ast.Constant) and n.value in BACKEND_NAMES}
            if named and "backend" in ast.unparse(node):
                found.append(f"{relative}:{node.lineno} compares with backend name(s) {sorted(named)}")
    return found


def backend_names_in_common(common: Path) -> list[str]:
    return [hit for f in sorted(common.rglob("*.py")) for hit in backend_names_in(f, str(f.relative_to(common)))]


def test_common_names_no_backend():
    """common reaches backends only through the registry: no backend module path in its code (only BUILTIN, the
    registry's list of kvlab's own), no `backend == "vmm"` switch. Pool options are engine options a spec's `pool`
    admits, paged's kernels are declared by its spec (`BackendSpec.kernels`), and reserve is a package beside vmm
    and paged."""
    assert backend_names_in_common(ROOT / "kvlab" / "common") == []


def test_the_backend_name_check_finds_planted_names(tmp_path):
    (tmp_path / "a.py").write_text('"""Docs may say kvlab.vmm."""\nif cfg.backend != "vmm":\n    pass\n')
    (tmp_path / "b.py").write_text('IMPL = "kvlab.paged.kernels.flex:paged_attention_flex"\nLAYOUT = "paged"\n')
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "registry.py").write_text('BUILTIN = {"reserve": "kvlab.reserve.spec"}\nX = "kvlab.reserve"\n')
    assert backend_names_in_common(tmp_path) == [
        "a.py:2 compares with backend name(s) ['vmm']",
        "b.py:1 module path 'kvlab.paged.kernels.flex:paged_attention_flex'",
        "kv/registry.py:2 module path 'kvlab.reserve'"]


def test_every_library_folder_lives_under_kvlab():
    """kvlab/common, kvlab/vmm, ... are real folders, so `kvlab.X` resolves by path for the interpreter and for
    tools that follow imports; the top-level common/, vmm/, ... are links to them, kept for the design's names."""
    packages = {p.name for p in (ROOT / "kvlab").iterdir() if (p / "__init__.py").is_file()}
    assert set(LINKED) <= packages and not any((ROOT / "kvlab" / name).is_symlink() for name in packages)
    for name in LINKED:
        link = ROOT / name
        assert link.is_symlink() and link.resolve() == (ROOT / "kvlab" / name).resolve(), \
            f"{name} must link to kvlab/{name}"
    stray = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and not p.is_symlink()}
    assert stray <= {"kvlab", "tests"}, f"library code outside kvlab/: {sorted(stray - {'kvlab', 'tests'})}"


def test_a_script_beside_the_clone_imports_the_installed_kvlab(tmp_path):
    """~/kvlab (the clone) and ~/exp.py: the folder named kvlab next to the script is not a package, and must not
    shadow the install (the Makefile's path entry holds only the kvlab link)."""
    (tmp_path / "kvlab").symlink_to(ROOT)
    (tmp_path / "exp.py").write_text("from kvlab import LLM\nimport kvlab.common.config\nprint(LLM.__name__)\n")
    for cwd in (tmp_path, ROOT.parent):
        proc = subprocess.run([sys.executable, str(tmp_path / "exp.py")], cwd=cwd, capture_output=True, text=True,
                              timeout=120, check=False)
        assert proc.returncode == 0 and proc.stdout.strip() == "LLM", proc.stderr[-2000:]


# -- backends outside kvlab's tree: the entry-point group kvlab.backends ----------------------------------------
SLAB_ENTRY = EntryPoint(name="slab", value="backends.slab", group=ENTRY_POINTS)


def test_an_entry_point_names_a_module_with_spec_or_the_spec_itself():
    assert load_spec(SLAB_ENTRY) is SLAB
    assert load_spec(EntryPoint("slab", "backends.slab:SPEC", ENTRY_POINTS)) is SLAB
    for value, error in (("backends.slab:PROBE", "names no BackendSpec"), ("no_such_module", "does not load")):
        with pytest.raises(ConfigError, match=error):
            load_spec(EntryPoint("slab", value, ENTRY_POINTS))
    with pytest.raises(ConfigError, match="declares a backend named 'slab'"):
        load_spec(EntryPoint("other", "backends.slab", ENTRY_POINTS))


def test_the_registry_looks_for_installed_backends_on_first_use_only():
    looked: list[int] = []

    def installed() -> list[EntryPoint]:
        looked.append(1)
        return [SLAB_ENTRY]

    registry = Registry(BUILTIN, find_installed=installed)
    assert not looked                                    # importing kvlab reads no package metadata
    assert registry.names() == (*BUILTIN, "slab") and registry.get("slab") is SLAB
    registry.specs()
    assert looked == [1]


@pytest.fixture
def slab_by_entry_point():
    """slab offered the way an installed package offers it (conftest registered it by register_backend)."""
    REGISTRY.unregister("slab")
    REGISTRY.discover([SLAB_ENTRY])
    yield
    REGISTRY.unregister("slab")
    REGISTRY.register(SLAB)


def test_an_entry_point_backend_gets_cli_flags_a_toml_table_and_builds(slab_by_entry_point, tmp_path):
    from helpers.invariants import SHAPE

    from kvlab.common.kv.seam import create_cache
    from kvlab.experiments.cli.flags import add_engine_flags, engine_config
    toml = tmp_path / "engine.toml"
    toml.write_text('backend = "slab"\n[slab]\nslab_spare_slots = 1\n')
    assert make_config(toml).options_of("slab").slab_spare_slots == 1
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    config = engine_config(vars(parser.parse_args(["--config", str(toml), "--slab-spare-slots", "2"])))
    assert config.backend == "slab" and config.options_of("slab").slab_spare_slots == 2
    cache = create_cache(config, SHAPE, accounting_only=True)
    assert cache.name == "slab" and cache.allocator.num_total_units() == config.kv_cache_bytes // (
        config.max_model_len * SHAPE.bytes_per_token) - 2


def test_a_decode_step_within_its_page_walks_down_the_vmm_rooms_without_a_driver_call():
    """The per-step path (issue 35's walk, tests/helpers/vmm_walk.py): the allocator, then the pages' books, no
    memory room (nothing is mapped when no page boundary is crossed) and no return to a room it left; a step that
    crosses into a new page reaches the driver."""
    from helpers.vmm_walk import returns, walks
    found = walks()
    assert found["decode, same page"] == ["allocator", "pages"] and returns(found["decode, same page"]) == 0
    assert "memory" in found["decode, new page"] and "memory" in found["admission"]


# -- sizes a reader can hold (issue 35) -----------------------------------------------------------------------------
MAX_METHODS, MAX_LINES = 20, 400


def methods_of(tree: ast.Module) -> dict[str, int]:
    """Each class's methods: every def in its body but properties (read as attributes)."""
    def is_property(f: ast.FunctionDef) -> bool:
        return any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)
    return {node.name: sum(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_property(f)
                           for f in node.body)
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def test_no_class_has_more_than_20_methods_and_no_module_more_than_400_lines():
    big_classes, long_modules = [], []
    for name, path in project_modules().items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_LINES:
            long_modules.append(f"{name}: {len(source.splitlines())} lines")
        big_classes += [f"{name}.{cls}: {n} methods" for cls, n in methods_of(ast.parse(source)).items()
                        if n > MAX_METHODS]
    assert not big_classes and not long_modules, big_classes + long_modules


def test_the_method_count_counts_every_def_but_properties():
    tree = ast.parse("class A:\n    @property\n    def p(self): ...\n" + "".join(
        f"    def m{i}(self): ...\n" for i in range(MAX_METHODS + 1)))
    assert methods_of(tree) == {"A": MAX_METHODS + 1}
