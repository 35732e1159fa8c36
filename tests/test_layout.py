"""The shape of the code: the README's module table is the files, `dg check defs` passes,
and no function or module outgrows what reads in one sitting."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ckpt_assets"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def _readme_modules() -> set[str]:
    text = (ROOT / "README.md").read_text()
    table = text.split("<!-- modules -->", 1)[1].split("<!-- /modules -->", 1)[0]
    names = set()
    for row in table.splitlines()[2:]:
        cell = row.split("|")[1] if row.startswith("|") else ""
        names |= set(re.findall(r"`([\w/]+\.py)`", cell))
    return names


def test_the_readmes_module_table_lists_every_module_of_ckpt_assets_and_no_other():
    files = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if p.name != "__init__.py"}
    assert _readme_modules() == files


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


def test_a_module_over_400_lines_says_at_its_top_why():
    unexplained = []
    for path in _python_files():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Why this module is long" not in doc:
                unexplained.append(str(path.relative_to(ROOT)))
    assert unexplained == []


def test_the_trainer_never_imports_dagster():
    for path in (ROOT / "trainer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) \
                    else [node.module or ""]
                assert not any(m == "dagster" or m.startswith("dagster.") for m in mods), path


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
