#!/usr/bin/env bash
# Run HERE, before a device call: fetch, as wheels for the GPU image's Python 3.12, what that image lacks
# (hydra-core, omegaconf, antlr4-python3-runtime; versions from constraints.txt) into .whl/ (git-ignored),
# and record the commit the working tree is at (the device gets no .git); with DATA_DIR set, a copy of the
# CIFAR-10 archive into .whl/data/ for the recipe's GPU seeds (never committed: .whl is ignored). Then call
# the device tool with carry [".whl"] and command "bash scripts/device/run.sh" (docs/reproducing.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
DEST=.whl
pin() { grep -E "^$1==" constraints.txt | head -1; }
rm -rf "$DEST" && mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  -d "$DEST" "$(pin hydra-core)" "$(pin omegaconf)"
# antlr4-python3-runtime 4.9.3 is published as source only: build its (pure-Python) wheel here
"$PY" -m pip wheel -q --no-deps -w "$DEST" "$(pin antlr4-python3-runtime)"
{
  echo "DIVISION_GIT_SHA=$(git rev-parse HEAD)"
  if [ -n "$(git status --porcelain --untracked-files=no -- . ':(exclude)results')" ]; then
    echo "DIVISION_GIT_DIRTY=true"
  else
    echo "DIVISION_GIT_DIRTY=false"
  fi
  echo "DIVISION_CODE_VERSION=$("$PY" -c 'import sys; sys.path.insert(0, "src"); from division.results import code_version; print(code_version())')"
} > "$DEST/provenance.env"
if [ -n "${DATA_DIR:-}" ] && [ -f "$DATA_DIR/cifar10_jpeg.tar.gz" ]; then
  mkdir -p "$DEST/data" && cp "$DATA_DIR/cifar10_jpeg.tar.gz" "$DEST/data/"
fi
ls -l "$DEST"
du -sh "$DEST"
