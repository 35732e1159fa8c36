"""A trainer process started before it is needed (`python -m trainer.process.standby`).

A relaunched attempt should train again at once, but a fresh interpreter spends about 2 s
importing torch, Dynamo (the first optimizer imports it) and the trainer before its first
step. A standby pays that while the attempt before it is still training: it imports what
every attempt imports, then blocks on one line of its stdin, the `Handoff` of the attempt
it is to become. It applies it (output, stdin, working directory, environment, argv,
`sys.path[0]`) and runs the attempt's module or script in this process as `python -m
MODULE` or `python SCRIPT` would have: the same `__main__`, the same exit status, the same
signal handling (none is installed before the handoff, so a SIGTERM until then ends it like
any fresh process).

An empty line or end of file (the orchestrator closed it unused, or died) ends it with
status 0, having done nothing. A `PING` line before the handoff is answered with `PONG` on
its stdout: the orchestrator's proof that it is alive and reading before it is handed an
attempt.

What a standby cannot take over: anything the interpreter reads at its own start (its
options, `PYTHON*`, the locale) or the native libraries torch loads read at import (thread
pools, allocators, CUDA). So the orchestrator starts it with the environment the next
attempt will have, less only the contract's and Pipes' own names
(`trainer.process.contract.reserved`), and hands it over only when no such variable has changed
since (`Handoff.unfit`); otherwise the attempt starts cold, as before. Any other variable
takes the attempt's value at the handoff, before the attempt's code runs (a library in
the orchestrator's process may add one of its own meanwhile: MLflow adds a telemetry id).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .contract import RANKS_LAUNCHER, reserved

MODULE = "trainer.process.standby"
PING, PONG = b"ping\n", b"pong\n"  # asked on its stdin before a handoff; answered on stdout
PACKAGE = Path(__file__).resolve().parents[1]  # trainer/
# A module run under a standby would start its own processes cold, so nothing is gained:
# several ranks start theirs through torchrun.
NOT_WARMED = frozenset({"trainer.ranks", RANKS_LAUNCHER, MODULE})
# Variables read when the interpreter starts or torch and its native libraries load: one
# that changed after a standby started means the standby is not what `python` would be.
READ_AT_START = ("PYTHON", "LC_", "LANG", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_",
                 "NUMEXPR_", "NUMPY_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "NCCL_",
                 "LD_", "MALLOC_", "GLIBC_", "TZ")


def entry(argv: list[str]) -> tuple[str, str] | None:
    """What `argv` runs, if a standby can run it: ("module", NAME) for `PYTHON -m NAME ...`,
    ("script", PATH) for `PYTHON PATH ...`; None for anything else (interpreter options,
    `-c`, a command that is not Python)."""
    if len(argv) >= 3 and argv[1] == "-m" and argv[2] not in NOT_WARMED:
        return "module", argv[2]
    if len(argv) >= 2 and argv[1].endswith(".py") and not argv[1].startswith("-"):
        return "script", argv[1]
    return None


def own_trainer(argv: list[str], cwd: str) -> str | None:
    """The project's own `trainer` (a `trainer.py` or `trainer/` in the directory `python`
    puts first on `sys.path` for `argv` run in `cwd`), or None. A standby has imported this
    package as `trainer` already, so the attempt's `import trainer` would get it, not the
    project's: such an attempt is never handed to a standby."""
    what = entry(argv)
    if what is None:
        return None
    kind, target = what
    first = Path(cwd) if kind == "module" else Path(cwd, target).parent
    for theirs in (first / "trainer.py", first / "trainer"):
        if theirs.exists() and theirs.resolve() != PACKAGE:
            return str(theirs)
    return None


def standing_env(env: dict[str, str]) -> dict[str, str]:
    """The part of an attempt's environment a standby starts with: all but what changes
    from attempt to attempt (the contract's and Pipes' names)."""
    return {k: v for k, v in env.items() if not reserved(k)}


def _interpreter(path: str) -> tuple[str, str]:
    """What `path` starts, symlinks resolved (a symlinked `.venv` is the same): the binary, and
    the directory Python finds a virtual environment from (pyvenv.cfg beside or above it). Not
    the binary alone: every venv's `python` links to its base interpreter."""
    return os.path.realpath(os.path.dirname(path)), os.path.realpath(path)


@dataclass(frozen=True)
class Handoff:
    """The attempt a standby becomes: the argv it would have been started with, its
    environment, working directory and output file."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    output: str

    def to_line(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> Handoff:
        raw = json.loads(line)
        return cls(list(raw["argv"]), dict(raw["env"]), raw["cwd"], raw["output"])

    def unfit(self, python: str, env: dict[str, str]) -> str | None:
        """Why a standby started as `python` with the environment `env` cannot become this
        attempt, or None when it can: the same interpreter, a module or script it can run,
        and none of the variables `READ_AT_START` changed."""
        if entry(self.argv) is None:
            return f"{' '.join(self.argv[:3])} is not `python -m MODULE` or `python SCRIPT.py`"
        if _interpreter(self.argv[0]) != _interpreter(python):
            return f"the attempt's interpreter is {self.argv[0]}, the standby's {python}"
        mine = standing_env(self.env)
        changed = sorted(k for k in mine.keys() | env.keys()
                         if mine.get(k) != env.get(k) and k.startswith(READ_AT_START))
        if changed:
            return f"the environment changed since the standby started ({', '.join(changed)})"
        return None

    def become(self) -> None:
        """Turn this process into the attempt, up to running its code (`run`)."""
        out = os.open(self.output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        for src, fd in ((out, 1), (out, 2), (devnull, 0)):
            os.dup2(src, fd)
        os.close(out)
        os.close(devnull)
        os.chdir(self.cwd)
        os.environ.clear()  # putenv/unsetenv too: C code reads the attempt's environment
        os.environ.update(self.env)

    def run(self) -> None:
        """Run the attempt's code in this process, as `python` would from its argv."""
        kind, target = entry(self.argv)
        if kind == "module":
            sys.argv = [target, *self.argv[3:]]
            sys.path[0] = os.getcwd()  # what `python -m` puts first
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *self.argv[2:]]
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # what `python SCRIPT` does
            runpy.run_path(target, run_name="__main__")


def main() -> int:
    # What every attempt imports first (torch with it): the cost a standby pays in advance.
    # Dynamo too: torch.optim imports it when the first optimizer takes its parameters
    # (`torch._disable_dynamo`), about 0.9 s of every attempt's start, warm or not.
    import torch._dynamo  # noqa: F401

    from .. import config, loop  # noqa: F401
    from ..api import session  # noqa: F401
    from . import report  # noqa: F401

    line = sys.stdin.buffer.readline()
    while line == PING:
        os.write(1, PONG)  # its stdout is the orchestrator's pipe until `become`
        line = sys.stdin.buffer.readline()
    if not line.strip():
        return 0
    handoff = Handoff.from_line(line)
    handoff.become()
    handoff.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
