#!/usr/bin/env bash
# Rehearse the device call here, on the CPU, before spending device time: an environment like the GPU
# image's (Python 3.12, torch 2.11, torchvision 0.26, triton 3.6, timm, numpy, pytest; no hydra-core,
# omegaconf or wandb), then scripts/device/run.sh in it exactly as the device runs it, with --dry-run, and the
# CPU tests of the GPU path, of the configs and of the compile route with the carried wheels on PYTHONPATH
# (torch 2.11 compiles differently: an nn.Sequential's Module.compile() ran eagerly there, unnoticed on 2.14).
#   bash scripts/device/rehearse.sh          (PY312=path/to/python3.12 if it is not on PATH)
set -euo pipefail
cd "$(dirname "$0")/../.."
ENV="${REHEARSAL_ENV:-/tmp/division_gpu_image}"
if [ ! -x "$ENV/bin/python" ]; then
  "${PY312:-python3.12}" -m venv "$ENV"
  "$ENV/bin/python" -m pip install -q torch==2.11.0 torchvision==0.26.0 triton==3.6.0 timm numpy pytest
fi
if "$ENV/bin/python" -c "import hydra" 2>/dev/null; then
  echo "rehearsal environment $ENV has hydra installed: it must lack it, as the GPU image does" >&2; exit 2
fi
[ -f .whl/provenance.env ] || bash scripts/device/prepare.sh
SITE="$(mktemp -d)"; OUT="$(mktemp -d)"
OUT="$OUT" DIVISION_SITE="$SITE" PYTHON="$ENV/bin/python" bash scripts/device/run.sh --dry-run
echo "run.sh left in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
PYTHONPATH="$SITE:$PWD/src" "$ENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_gpu_path.py tests/test_triton.py tests/test_configs.py tests/test_compile.py
echo "rehearsal passed: $("$ENV/bin/python" -c 'import sys, torch, triton; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}")')"
