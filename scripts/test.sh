#!/usr/bin/env bash
# Installs what the tests need, then runs the whole suite (slow end-to-end tests included).
# Pass pytest arguments to narrow it, e.g.: bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check trainer ckpt_assets tests benchmarks
exec .venv/bin/python -m pytest "$@"
