#!/usr/bin/env bash
# Creates .venv (if needed) and installs the project with pinned dependencies.
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
  .venv/bin/python -m pip install --quiet --upgrade pip
  # constraints.txt pins the whole tree (the Dagster family in lockstep, torch 2.13.0 CPU).
  .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[test]"
  echo "$want" > "$stamp"
fi
