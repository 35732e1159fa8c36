#!/usr/bin/env bash
# Installs everything, then runs the demo on the embedded default instance (dagster_home/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DAGSTER_HOME="$PWD/dagster_home"
exec .venv/bin/python scripts/demo.py
