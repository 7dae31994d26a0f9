#!/usr/bin/env bash
# Runs a queue of experiment runs one at a time, each at the commit its line names, and copies every finished
# run into this checkout's results/runs. It is how the committed accuracy sweeps are made: a table row should
# come from one clean commit, while the main checkout moves on.
#
#   scripts/run_queue.sh QUEUE_FILE [THREADS] [JOBS]
#
# QUEUE_FILE: one run per line, "<commit> <hydra overrides...>"; blank lines and lines starting with # are
# skipped. The file is read again before each run starts, so lines may be added, reordered or deleted (as
# finished ones are, once committed) while it runs; each line runs at most once per invocation.
# JOBS (default 1): runs at a time. On a CPU one run on all cores is fastest; on a GPU, where a small model's
# run is bound by its host thread, several runs share the device (e.g. THREADS=4 JOBS=4 on 16 cores).
# Each commit gets a git worktree beside this checkout (../wt-<commit>), so relative paths such as
# DATA_DIR=../shared/datasets mean the same there and land in the run id the same way. Runs use this
# checkout's .venv (PY=... to choose another; PYTHONPATH is kept, after the worktree's src) and
# trainer.threads=THREADS (default 2; not part of the run id). Finished runs are skipped (skip_done) and
# interrupted ones continue from their checkpoints (resume) when the experiment config sets those, as the
# committed experiments do. SIGTERM stops the runs in flight; start the queue again to continue.
# Logs: ../wt-logs/<commit>-<override values>.log.
set -uo pipefail
queue=$(realpath "${1:?usage: scripts/run_queue.sh QUEUE_FILE [THREADS] [JOBS]}")
threads=${2:-2}
jobs=${3:-1}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || { echo "JOBS must be a positive whole number, got '$jobs'" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-$root/.venv/bin/python}
logs=$(dirname "$root")/wt-logs
mkdir -p "$logs"
[ -x "$py" ] || { echo "no python at $py: run 'make setup' first or set PY" >&2; exit 2; }
declare -A label=()  # "<sha> <overrides>" of each run in flight, by its pid
stop_all() {
  local pid
  for pid in "${!label[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  wait
}
trap 'stop_all; exit 143' TERM INT

harvest() {  # copies finished runs of worktree $1 into this checkout, leaving existing copies alone
  local result dir rel
  for result in "$1"/results/runs/*/*/result.json; do
    [ -f "$result" ] && grep -q '"status": "ok"' "$result" || continue
    dir=$(dirname "$result"); rel=${dir#"$1"/}
    [ -e "$root/$rel/result.json" ] && continue
    mkdir -p "$root/$rel"
    find "$dir" -maxdepth 1 -type f ! -name '*.pt' -exec cp {} "$root/$rel/" \;  # all but checkpoints
    echo "$(date -Is) harvested $rel"
  done
}

declare -A attempted=()
next_line() {  # the queue's first run line that this invocation has not yet run, read afresh
  local line
  while IFS= read -r line || [ -n "$line" ]; do
    case "$line" in ''|'#'*) continue ;; esac
    [ -z "${attempted[$line]+set}" ] && { printf '%s\n' "$line"; return 0; }
  done < "$queue"
  return 1
}

start() {  # launches queue line $1 in the background, at its commit's worktree
  local commit overrides sha worktree log
  read -r commit overrides <<< "$1"
  sha=$(git -C "$root" rev-parse --short=7 "$commit^{commit}") || { echo "unknown commit '$commit'" >&2; return 1; }
  worktree=$(dirname "$root")/wt-$sha
  [ -d "$worktree" ] || git -C "$root" worktree add --detach "$worktree" "$sha" >/dev/null || return 1
  log=$logs/$sha-$(echo "$overrides" | sed 's/[^ =]*=//g' | tr -c 'A-Za-z0-9_.,\n-' '_').log
  echo "$(date -Is) start $sha $overrides (log $log)"
  (cd "$worktree" && PYTHONPATH="$worktree/src${PYTHONPATH:+:$PYTHONPATH}" \
    exec "$py" train.py $overrides trainer.threads="$threads") >> "$log" 2>&1 &
  label[$!]="$sha $overrides"
}

while :; do
  while (( ${#label[@]} < jobs )) && line=$(next_line); do
    attempted[$line]=1
    start "$line" || { stop_all; exit 2; }
  done
  (( ${#label[@]} )) || break
  finished=
  wait -n -p finished "${!label[@]}"
  status=$?
  [ -n "$finished" ] || continue
  echo "$(date -Is) end (exit $status) ${label[$finished]}"
  harvest "$(dirname "$root")/wt-${label[$finished]%% *}"
  unset "label[$finished]"
done
