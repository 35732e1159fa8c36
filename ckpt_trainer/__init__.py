"""The trainer's public API under the one name every project can import.

    from ckpt_trainer import CheckpointSession, ResumableLoader
    python -m ckpt_trainer.ranks --nproc-per-node 2 -- python train.py

Many projects have a `trainer.py` (or a `trainer/` package) of their own next to the script,
and Python puts the script's directory first on `sys.path`: there `import trainer` finds
the project's module. `ckpt_trainer` is the trainer's files (`trainer/`) under a name no
project shadows, so it works in every directory.

Each module of ours is loaded once per process, whichever name asks for it:

* where `trainer` is ours, `ckpt_trainer.X` *is* the module `trainer.X` (the finder below
  hands out the same module object), so a task run by `python -m trainer` that imports
  `ckpt_trainer` shares its classes, its errors and its state with the trainer;
* where a project shadows `trainer`, this package's path is `trainer/` itself and its
  modules load under this name only. That works natively because every import inside
  `trainer/` is relative: nothing of ours names `trainer`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path

HOME = Path(__file__).resolve().parent.parent / "trainer"
ORIGINAL = "trainer"


def _ours_is_trainer() -> bool:
    """Whether `import trainer` gives this project's trainer in this process."""
    loaded = sys.modules.get(ORIGINAL)
    if loaded is not None:
        return Path(getattr(loaded, "__file__", "") or "").resolve().parent == HOME
    spec = importlib.util.find_spec(ORIGINAL)
    return spec is not None and Path(spec.origin or "").resolve().parent == HOME


class _SameModule(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """`ckpt_trainer.X` found as the module `trainer.X`: one module object, two names."""

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        real = importlib.util.find_spec(ORIGINAL + fullname[len(__name__):])
        if real is None:
            return None
        return importlib.util.spec_from_loader(
            fullname, self, origin=real.origin,
            is_package=real.submodule_search_locations is not None)

    def create_module(self, spec):
        if spec.name.endswith(".__main__"):
            return None  # `python -m ckpt_trainer.X` runs the code (get_code), never imports it
        module = importlib.import_module(ORIGINAL + spec.name[len(__name__):])
        spec.loader_state = module.__spec__  # the import system sets ours in its place
        return module

    def exec_module(self, module) -> None:
        """The module was executed once, under its first name: only its own spec goes back."""
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, fullname: str):
        original = ORIGINAL + fullname[len(__name__):]
        return importlib.util.find_spec(original).loader.get_code(original)

    def get_source(self, fullname: str):
        return None


if _ours_is_trainer():
    import trainer as _trainer

    __path__ = []  # submodules come from the finder only
    if not any(isinstance(f, _SameModule) for f in sys.meta_path):
        sys.meta_path.insert(0, _SameModule())
    __all__ = _trainer.__all__
    __getattr__ = _trainer.__getattr__
else:
    __path__ = [str(HOME)]
    _init = HOME / "__init__.py"
    exec(compile(_init.read_bytes(), str(_init), "exec"))
