"""The shape of the code: docs/architecture.md's module table is the files, the layers of
`ckpt_assets/` import each other without a cycle and only `defs/`'s users import `defs/`,
Dagster's private API sits in one module, `dg check defs` passes, and no function or module
outgrows what reads in one sitting."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ckpt_assets"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def _documented_modules() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("<!-- modules -->", 1)[1].split("<!-- /modules -->", 1)[0]
    names = set()
    for row in table.splitlines()[2:]:
        cell = row.split("|")[1] if row.startswith("|") else ""
        names |= set(re.findall(r"`([\w/]+\.py)`", cell))
    return names


def test_the_architecture_pages_module_table_lists_every_module_of_ckpt_assets_and_no_other():
    files = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if p.name != "__init__.py"}
    assert _documented_modules() == files


def _module_name(path: Path) -> str:
    top = path.parent
    while (top.parent / "__init__.py").is_file():
        top = top.parent
    parts = path.relative_to(top.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path) -> set[str]:
    """The modules `path` imports when it runs: top-level and lazy (inside functions) alike,
    relative imports resolved; only `if TYPE_CHECKING:` blocks, never executed, are left out."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    package = _module_name(path).split(".") if path.name == "__init__.py" \
        else _module_name(path).split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return found


def _import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in package.rglob("*.py")}
    return {name: {m for m in _runtime_imports(path) if m in modules and m != name
                   and m != package.name}
            for name, path in modules.items()}


def _package_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Which packages of `package` import which (a module at its top is its own node)."""
    def of(module: str) -> str:
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for name, deps in _import_graph(package).items():
        graph.setdefault(of(name), set()).update(of(d) for d in deps if of(d) != of(name))
    for deps in list(graph.values()):
        for d in deps:
            graph.setdefault(d, set())
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_of_ckpt_assets_imports_another_in_a_cycle_lazy_imports_included():
    assert _cycles(_import_graph()) == []


def test_no_package_of_ckpt_assets_imports_another_in_a_cycle_lazy_imports_included():
    # The packages are layers (docs/architecture.md): each looks only down, at the ones it
    # stands on, never back up at one that stands on it.
    assert _cycles(_package_graph()) == []


def test_no_module_of_the_trainer_imports_another_in_a_cycle_lazy_imports_included():
    assert _cycles(_import_graph(ROOT / "trainer")) == []


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_layout_checks_see_a_relative_lazy_import_and_a_cycle_between_packages(tmp_path):
    pkg = tmp_path / "pkg"
    for sub, text in (("a", "def f():\n    from ..b import m  # lazy\n"),
                      ("b", "from ..a import m\n")):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
        (pkg / sub / "m.py").write_text(text)
    (pkg / "__init__.py").write_text("")
    assert _cycles(_import_graph(pkg)) == [["pkg.a.m", "pkg.b.m"]]
    assert _cycles(_package_graph(pkg)) == [["pkg.a", "pkg.b"]]


DEFS_USERS = ("ckpt_assets.defs", "ckpt_assets.definitions", "ckpt_assets.cli")


def test_only_definitions_the_cli_and_defs_itself_import_defs():
    offenders = sorted(f"{name} imports {dep}" for name, deps in _import_graph().items()
                       for dep in deps
                       if dep.startswith(("ckpt_assets.defs", "ckpt_assets.definitions"))
                       and not name.startswith(DEFS_USERS))
    assert offenders == []


def test_dagsters_private_api_is_imported_in_one_module_only():
    private = sorted(_module_name(p) for p in PACKAGE.rglob("*.py")
                     if any(m.startswith("dagster._") for m in _runtime_imports(p)
                            | _type_only_imports(p)))
    assert private == ["ckpt_assets.base.dagster_private"]


def _type_only_imports(path: Path) -> set[str]:
    return {node.module for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module}


def test_defs_holds_only_dagster_definitions_and_the_cli_is_its_own_package():
    assert {p.name for p in (PACKAGE / "defs").glob("*.py")} == {
        "__init__.py", "assets.py", "checks.py", "check_runs.py", "io_managers.py",
        "jobs.py", "partitions.py", "resources.py", "sensors.py"}


def _python_files():
    for root in ("trainer", "ckpt_assets"):
        yield from sorted((ROOT / root).rglob("*.py"))


def test_no_function_is_longer_than_reads_in_one_sitting():
    long = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert long == []


def test_no_module_is_over_400_lines():
    long = [f"{p.relative_to(ROOT)} ({n})" for p in _python_files()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert long == []


def test_the_trainer_never_imports_dagster():
    for path in (ROOT / "trainer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) \
                    else [node.module or ""]
                assert not any(m == "dagster" or m.startswith("dagster.") for m in mods), path


def _imports_through_test_helpers(path: Path) -> set[str]:
    """What `path` imports, and what the modules of tests/ it imports import, on and on."""
    seen, todo, found = set(), [path], set()
    while todo:
        mods = _runtime_imports(todo.pop())
        found |= mods
        for mod in mods:
            helper = ROOT.joinpath(*mod.split(".")).with_suffix(".py")
            if mod.startswith("tests.") and helper.is_file() and helper not in seen:
                seen.add(helper)
                todo.append(helper)
    return found


def test_the_standalone_trainers_tests_import_neither_dagster_nor_ckpt_assets():
    # They prove what a user of the trainer alone gets: nothing of the orchestrator may be
    # what makes them pass.
    leaks = {}
    for path in sorted((ROOT / "tests" / "standalone").glob("test_*.py")):
        mods = {m for m in _imports_through_test_helpers(path)
                if m.split(".")[0] in ("dagster", "ckpt_assets")}
        if mods:
            leaks[path.name] = sorted(mods)
    assert leaks == {}


@pytest.mark.slow
def test_dg_check_defs_passes():
    dg = shutil.which("dg", path=str(ROOT / ".venv" / "bin")) or shutil.which("dg")
    if dg is None:
        pytest.fail("dg not found: bash scripts/setup.sh installs dagster-dg-cli")
    env = {**os.environ, "VIRTUAL_ENV": str(ROOT / ".venv")}
    proc = subprocess.run([dg, "check", "defs"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "All definitions loaded successfully" in proc.stdout + proc.stderr
