#!/usr/bin/env bash
# One prepared run of every GPU check (see scripts/gpu_check.py); --dry-run checks it composes, on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
exec "$PY" scripts/gpu_check.py "$@"
