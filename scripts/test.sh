#!/usr/bin/env bash
# Installs what the tests need, then runs the whole suite (slow end-to-end tests included).
# Pass pytest arguments to narrow it, e.g.: bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check trainer ckpt_assets tests benchmarks
# The tests mostly wait (on daemons, trainers, servers): in one process the suite keeps two
# cores a third busy. So it runs on several workers (pytest-xdist); `-n 0` runs it in one.
exec .venv/bin/python -m pytest -n "${CKPT_TEST_WORKERS:-3}" --dist worksteal "$@"
