#!/usr/bin/env bash
# Creates .venv (if needed) and installs the project with pinned dependencies; as root on
# Debian, also the distribution's Chromium (tests/e2e/test_browser.py) and PostgreSQL (the team-
# instance tests).
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.ckpt-assets-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # pip's own output (warnings about the machine's package indexes included) goes to a log,
  # shown when the install fails.
  log=.venv/pip-install.log
  echo "setup: installing the pinned stack into .venv (pip's log: $log)"
  # constraints.txt pins the whole tree (the Dagster family in lockstep, torch 2.13.0 CPU;
  # the training frameworks of tests/frameworks/ come with the test extra).
  # The tree is byte-compiled after the install, on every core: where PYTHONDONTWRITEBYTECODE
  # is set no import writes a .pyc, so without them every process would compile every module
  # it imports; pip's own compiling is one file at a time on one core.
  if ! { .venv/bin/python -m pip install --quiet --no-compile --upgrade pip &&
         .venv/bin/python -m pip install --quiet --no-compile -c constraints.txt -e ".[test]"
       } > "$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "setup: pip install failed (above: the end of $log); fix what it names and run again" >&2
    exit 1
  fi
  # A file written for a newer Python (torch ships py312_intrinsics.py) does not compile and
  # stays uncompiled, as pip leaves it, so compileall's status is not checked. What nothing
  # here imports is left out: the packages' own test suites, pip, setuptools, and moto's
  # CloudFormation linter (a sixth of the files).
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  .venv/bin/python -m compileall -q -j 0 -x '/(tests?|pip|setuptools|cfnlint)/' "$site" \
    >> "$log" 2>&1 || true
  echo "$want" > "$stamp"
fi

# The browser test drives /usr/bin/chromium through Playwright (whose own browser download
# needs a CDN that CI cannot reach). Without root or apt the test skips, saying how to get it.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "setup: installing Chromium (apt-get install chromium) for tests/e2e/test_browser.py"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
         DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           chromium fonts-liberation >/dev/null; }; then
    echo "setup: WARNING: could not install chromium; tests/e2e/test_browser.py will fail" >&2
  fi
fi

# The team-instance tests start a throwaway PostgreSQL server (initdb, pg_ctl, postgres).
# Debian's `postgresql` package keeps them in /usr/lib/postgresql/<major>/bin, off the PATH;
# the tests look there too. Without root or apt the tests skip, saying how to get them.
has_initdb() { command -v initdb >/dev/null || compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; }
if ! has_initdb && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "setup: installing PostgreSQL (apt-get install postgresql) for the team-instance tests"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
         DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           postgresql >/dev/null; }; then
    echo "setup: WARNING: could not install postgresql; the PostgreSQL tests will fail" >&2
  fi
fi

# Matplotlib (the loss plot) builds its font cache on first use by running `fc-list`; built
# here, once, so that no test's first plot starts a process (the fast tests refuse to).
.venv/bin/python -c 'import matplotlib.font_manager' >/dev/null 2>&1 || true
