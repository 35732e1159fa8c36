"""`dagster dev` (webserver + daemon) on a temporary instance, and a headless Chromium driven
by Playwright, for tests/e2e/test_browser.py.

The browser is the distribution's Chromium (`/usr/bin/chromium`, Debian's `chromium` package,
installed by scripts/setup.sh when run as root): Playwright's own browser download cannot
work where only PyPI and the Debian mirror are reachable.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

from tests.daemon_harness import BIN, ROOT, Daemon, fresh_instance
from tests.polling import wait_for
from tests.ports import free_port

CHROMIUM = Path(os.environ.get("CKPT_TEST_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = ROOT / "test-artifacts" / "browser"
INSTALL_HINT = ("to run it: `sudo apt-get install -y chromium` (Debian; "
                "`bash scripts/setup.sh` does it when run as root) and `bash scripts/setup.sh` "
                "for Playwright, or set CKPT_TEST_CHROMIUM to a Chromium binary")


def missing_browser() -> str | None:
    """Why the browser test cannot run here, or None when it can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return f"the `playwright` package is not installed; {INSTALL_HINT}"
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM}; {INSTALL_HINT}"
    return None


def browser_required() -> bool:
    """In CI, or as root with apt (where scripts/setup.sh installs Chromium), a missing
    browser is a failure, not a skip."""
    return bool(os.environ.get("CI")) or (os.geteuid() == 0 and shutil.which("apt-get")
                                          is not None)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


class DagsterDev(Daemon):
    """The daemon harness, for `dagster dev` (its webserver, daemon and code servers share
    its process group; `stop` waits for all of them)."""


def start_dagster_dev(workdir: Path, store: str, timeout: float = 240,
                      extra_env: dict | None = None) -> tuple[DagsterDev, str]:
    """`dagster dev` from the repository root on a fresh DAGSTER_HOME under `workdir`.

    Returns the harness object (the CLI, the instance, heartbeats, waiting, and a `stop()`
    that ends the whole process group and any trainer left over) and the webserver's URL."""
    home, env, instance = fresh_instance(workdir, store, extra_env)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = workdir / "dagster-dev.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(BIN / "dagster"), "dev", "-h", "127.0.0.1", "-p", str(port)],
                                cwd=ROOT, env=env, start_new_session=True, stdout=log,
                                stderr=subprocess.STDOUT)
    dev = DagsterDev(home, store, env, proc, log_path)
    dev._instance = instance
    threading.Thread(target=dev._watch_active, daemon=True).start()

    def answers() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"dagster dev exited {proc.returncode} before answering on "
                                 f"{url}:\n{dev.log_tail(60)}")
        return _answers(f"{url}/server_info")

    try:
        wait_for(answers, timeout, 0.5, f"dagster dev to answer on {url}",
                 lambda: dev.log_tail(60))
    except AssertionError:
        dev.stop()
        raise
    return dev, url


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:100] or "page"
