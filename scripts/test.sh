#!/usr/bin/env bash
# Installs what the tests need, then runs the whole suite (slow end-to-end tests included).
# Pass pytest arguments to narrow it, e.g.: bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check trainer ckpt_assets tests benchmarks
# The whole suite mostly waits (on daemons, trainers, servers): in one process it keeps two
# cores a third busy, so it runs on three workers (pytest-xdist). The fast tests alone wait
# on nothing: a worker per core, as a third worker's share of CPU only adds its start-up (on
# 2 cores: 44 s on two workers, 47 s on three, 69 s in one process). `-n 0` runs one.
workers=3
for arg in "$@"; do
  if [[ "$arg" == "not slow" ]]; then workers=$(nproc); fi
done
exec .venv/bin/python -m pytest -n "${CKPT_TEST_WORKERS:-$workers}" --dist worksteal "$@"
