"""Shared pytest fixtures, and the rule that keeps `-m "not slow"` fast.

S3: a real `moto_server` process on a loopback port, talked to over HTTP exactly as a
MinIO or AWS endpoint would be (no in-process mocking).

A test that starts a process or a server (moto_server, a dagster-daemon, a trainer, the
dagster CLI, PostgreSQL, Chromium) is marked `slow`; any other test that tries, in its set-up
or its body, fails, naming what it tried to start. That keeps the fast suite in-process and
quick. (Tear-down is left alone: it is where a session's servers are stopped, after
whichever test ran last.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt_assets.lifecycle.settings import Setting
from tests.polling import wait_for
from tests.ports import free_port

SLOW = "slow"
# The warm standby (ckpt_assets/attempt/warm_start.py) is on in every test, as users get it;
# a test that turns it off says why. Those marked `warm_standby` have it as their subject:
# on for them even where the environment turns it off for the rest.
WARM_STANDBY = "warm_standby"
# Fixtures that start a server process. A session-scoped one may already be running when a
# fast test asks for it, so asking is refused too, not only starting one.
PROCESS_FIXTURES = frozenset({"moto_server", "s3_env", "postgres_server"})
# The one program a fast test may run: `git`, the code-version probe of the trainer's
# lineage (trainer/process/code_version.py), which reads the repository and exits at once (cached
# per directory). Everything else is a process under test, and so a slow test.
FAST_TOOLS = frozenset({"git"})
_POPEN = subprocess.Popen  # the class itself, whatever a test puts in its module's place
_POPEN_INIT = _POPEN.__init__


class ProcessInFastTest(RuntimeError):
    """A test without the `slow` marker tried to start a process."""


def _fast_rule(item: pytest.Item) -> str:
    return (f"{item.nodeid} is not marked slow, so it must not start a process or server: "
            "test the decision in-process (call the function, `main([...])`), or mark the "
            "test @pytest.mark.slow if its point is the real process")


@contextlib.contextmanager
def _no_processes(item: pytest.Item) -> Iterator[list]:
    tried: list = []

    def refuse(self, args, *a, **kw):
        program = args if isinstance(args, str | bytes | os.PathLike) else args[0]
        words = os.path.basename(os.fsdecode(program)).split()
        if words and words[0] in FAST_TOOLS:
            return _POPEN_INIT(self, args, *a, **kw)
        tried.append(args)
        raise ProcessInFastTest(f"{_fast_rule(item)}; it started {args!r}")

    previous, _POPEN.__init__ = _POPEN.__init__, refuse
    try:
        yield tried
    finally:
        _POPEN.__init__ = previous


def _guarded_phase(item: pytest.Item):
    if item.get_closest_marker(SLOW) is not None:
        return (yield)
    with _no_processes(item) as tried:
        result = yield
    if tried:  # raised inside code that may have caught it: fail the test regardless
        pytest.fail(f"{_fast_rule(item)}; it started {tried[0]!r}", pytrace=False)
    return result


def pytest_configure(config):
    # A shell that starts the suite in the background (nohup, `&` without job control) hands
    # it SIGINT ignored. Dagster's in-process execution then maps SIGTERM to SIGINT's handler
    # (dagster._utils.interrupts.setup_interrupt_handlers), so this process would ignore
    # SIGTERM from its first `materialize()` on, and so would every process a later test
    # starts by hand. The suite runs as it does in the foreground, wherever it is started.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _warm_standby_where_it_is_the_subject(request, monkeypatch):
    if request.node.get_closest_marker(WARM_STANDBY) is not None:
        monkeypatch.setenv(Setting.WARM_TRAINER.value, "1")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    asked = PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))
    if asked and item.get_closest_marker(SLOW) is None:
        pytest.fail(f"{_fast_rule(item)}; it asks for {sorted(asked)}", pytrace=False)
    return (yield from _guarded_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded_phase(item))



def _moto_server_command() -> list[str]:
    """moto's server with its conditional writes atomic (`tests/atomic_moto_server.py`)."""
    return [sys.executable, str(Path(__file__).parent / "atomic_moto_server.py")]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means the server is up
    except OSError:
        return False


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """Start moto's S3 server on 127.0.0.1 (`_moto_server_command`), yield its endpoint URL,
    stop it."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("moto") / "moto_server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*_moto_server_command(), "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    def up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"moto_server exited with {proc.returncode}:\n{log_path.read_text()}")
        return _answers(f"{endpoint}/moto-api/")

    try:
        wait_for(up, 30, 0.05, f"moto_server to answer on {endpoint}", log_path.read_text)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def postgres_server():
    """One real PostgreSQL server for the session (a fresh cluster on a free loopback port,
    tests/postgres_server.py); each module that uses it makes its own databases on it."""
    from tests.postgres_server import require_postgres, running_postgres

    require_postgres()
    with running_postgres(free_port()) as server:
        yield server


@pytest.fixture
def aws_env(monkeypatch, tmp_path) -> None:
    """The standard AWS environment with test credentials, and no endpoint: a test sets
    AWS_ENDPOINT_URL to where it wants the client to go."""
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    # Keep a developer's ~/.aws out of the picture.
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config-none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials-none"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture
def s3_env(moto_server, aws_env, monkeypatch):
    """Point the standard AWS environment at moto and create a fresh bucket."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)

    import boto3

    bucket = f"test-{uuid.uuid4().hex[:16]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    yield {"endpoint": moto_server, "bucket": bucket, "uri": f"s3://{bucket}/ckpts"}


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """`uninterrupted(cfg)`: the final training state of `cfg` trained without a fault
    (`tests.trainer_proc.uninterrupted_state`), trained once per config and test session:
    the first worker that needs it trains it, the others wait for it and load it (never
    across sessions: the code under test may have changed)."""
    import hashlib
    import os

    import torch

    from tests.trainer_proc import uninterrupted_state
    from trainer.storage.file_lock import exclusive_lock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if base.name.startswith("popen-gw") else base  # xdist's workers
    cache = shared / "uninterrupted-states"
    cache.mkdir(exist_ok=True)
    done: dict[str, dict] = {}

    def get(cfg: dict) -> dict:
        key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
        if key not in done:
            path = cache / f"{key}.pt"
            dir_fd = os.open(cache, os.O_RDONLY)
            try:
                with exclusive_lock(dir_fd, f"{key}.lock", "an uninterrupted state", wait_s=900):
                    if not path.exists():
                        state = uninterrupted_state(tmp_path_factory.mktemp("uninterrupted"), cfg)
                        torch.save(state, cache / f"{key}.part")
                        os.replace(cache / f"{key}.part", path)
            finally:
                os.close(dir_fd)
            done[key] = torch.load(path, weights_only=False)
        return done[key]

    return get


@pytest.fixture
def checkpoint_store(tmp_path):
    """The test's own local checkpoint store resource: where a decision is created once."""
    from ckpt_assets.defs.resources import CheckpointStore

    return CheckpointStore(uri=str(tmp_path / "store"))
