"""The trainer's public API under a name no user project shadows.

    from ckpt_trainer import CheckpointSession, ResumableLoader
    python -m ckpt_trainer.ranks --nproc-per-node 2 -- python train.py

Many projects have a `trainer.py` (or a `trainer/` package) of their own, next to the
script. Python puts the script's directory (and, for `python -m`, the working directory)
first on `sys.path`, so there `import trainer` finds the project's module, not this
package, and one interpreter cannot hold two top-level modules named `trainer`. Under this
name the same files load as a second, independent copy: `ckpt_trainer.X` is
`trainer/X.py`, compiled with its imports of `trainer` and `trainer.*` read as
`ckpt_trainer` and `ckpt_trainer.*` (the finder below), so not one of them reaches the
project's `trainer`. Nothing is duplicated on disk, `import trainer` keeps working as
before, and a process uses one name or the other (the two copies share no state).
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.util
import sys
from pathlib import Path

ORIGINAL = "trainer"
SOURCE = Path(__file__).resolve().parent.parent / ORIGINAL

__all__ = ["CheckpointSession", "ResumableLoader"]


def _renamed(module: str | None) -> str | None:
    """`trainer[.x]` as `ckpt_trainer[.x]`; any other module name as it is."""
    if module == ORIGINAL or (module or "").startswith(ORIGINAL + "."):
        return __name__ + module[len(ORIGINAL):]
    return module


class _Rename(ast.NodeTransformer):
    """`import trainer[.x] [as y]` and `from trainer[.x] import y`, under this name
    (`import trainer` binds `trainer` still; `import trainer.x` loads `ckpt_trainer.x`)."""

    def visit_Import(self, node: ast.Import) -> ast.AST:
        for alias in node.names:
            if alias.name == ORIGINAL and alias.asname is None:
                alias.asname = ORIGINAL
            alias.name = _renamed(alias.name)
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST:
        if node.level == 0:
            node.module = _renamed(node.module)
        return node


class _Loader(importlib.abc.Loader):
    def __init__(self, path: Path):
        self.path = path

    def get_code(self, fullname: str):
        """(`python -m` asks for the code itself.) The file's own name, so tracebacks show
        the real lines; never cached as bytecode: `trainer/X.py`'s cache is the original's."""
        tree = _Rename().visit(ast.parse(self.path.read_bytes(), str(self.path)))
        return compile(tree, str(self.path), "exec", dont_inherit=True)

    def is_package(self, fullname: str) -> bool:
        return self.path.name == "__init__.py"

    def exec_module(self, module) -> None:
        exec(self.get_code(module.__name__), module.__dict__)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `ckpt_trainer.X` (any depth) among the original package's files."""

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        rel = Path(*fullname.split(".")[1:])
        package, module = SOURCE / rel / "__init__.py", (SOURCE / rel).with_suffix(".py")
        if package.is_file():
            return importlib.util.spec_from_file_location(
                fullname, package, loader=_Loader(package),
                submodule_search_locations=[str(SOURCE / rel)])
        if module.is_file():
            return importlib.util.spec_from_file_location(fullname, module, loader=_Loader(module))
        return None


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())


def __getattr__(name: str):
    if name == "CheckpointSession":
        from ckpt_trainer.session import CheckpointSession

        return CheckpointSession
    if name == "ResumableLoader":
        from ckpt_trainer.data import ResumableLoader

        return ResumableLoader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
