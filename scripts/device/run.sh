#!/usr/bin/env bash
# Run THERE, on the GPU machine (the device tool's command: bash scripts/device/run.sh [gpu_check options]).
# Installs the carried wheels (.whl/, made by prepare.sh) into a temporary folder on PYTHONPATH, runs
# scripts/gpu_check.py within its time budget, and leaves at most 8 files in $OUT: the log, a one-screen
# summary, and one tarball of every file the checks wrote under results/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/division_out}"
SITE="${DIVISION_SITE:-/tmp/division_site}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
  || { echo "installing the carried wheels failed" | tee "$OUT/summary.txt"; exit 3; }
set -a; . .whl/provenance.env; set +a
export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 WANDB_MODE=disabled
[ -d .whl/data ] && export DATA_DIR="$PWD/.whl/data"  # the carried CIFAR-10 archive (prepare.sh)
marker=$(mktemp); sleep 1
"$PY" scripts/gpu_check.py --summary "$OUT/summary.txt" "$@" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
find results -type f -newer "$marker" | sort > "$OUT/results_files.txt"
tar czf "$OUT/results.tar.gz" -T "$OUT/results_files.txt"
echo "exit $rc; $(wc -l < "$OUT/results_files.txt") result files in results.tar.gz"
exit "$rc"
