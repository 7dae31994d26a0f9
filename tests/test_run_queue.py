"""scripts/run_queue.sh: each queue line runs once, at its commit, even when lines are deleted while it runs."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for train.py: records its arguments and the commit it runs at; the run of x=1 deletes its own
# queue line, as committing a finished run does.
echo "$(git rev-parse --short=7 HEAD) $*" >> "$RUN_LOG"
case "$*" in *x=1*) sed -i '/x=1$/d' "$QUEUE" ;; esac
"""

GIT_IDENTITY = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def _git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, env={**os.environ, **GIT_IDENTITY}, check=True,
                          capture_output=True, text=True).stdout.strip()


def _commit(repo, message):
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", message)
    return _git(repo, "rev-parse", "--short=7", "HEAD")


def _repo_with_the_script(tmp_path):
    """A git repository holding scripts/run_queue.sh, and its first commit."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "run_queue.sh", repo / "scripts" / "run_queue.sh")
    _git(repo, "init", "-q")
    return repo, _commit(repo, "first")


def _fake_python(tmp_path, text):
    fake = tmp_path / "fake_python"
    fake.write_text(text)
    fake.chmod(0o755)
    return fake


def test_every_line_runs_once_at_its_commit_when_a_finished_line_is_deleted(tmp_path):
    repo, first = _repo_with_the_script(tmp_path)
    (repo / "later.txt").write_text("later\n")
    second = _commit(repo, "second")
    fake = _fake_python(tmp_path, FAKE_PYTHON)
    queue = tmp_path / "queue.txt"
    queue.write_text(f"# a comment\n{first} x=1\n{first} x=2\n\n{second} x=3\n")
    run_log = tmp_path / "runs.log"
    env = {**os.environ, "PY": str(fake), "RUN_LOG": str(run_log), "QUEUE": str(queue)}
    subprocess.run(["bash", "scripts/run_queue.sh", str(queue), "1"], cwd=repo, env=env, check=True,
                   capture_output=True, text=True, timeout=60)

    assert run_log.read_text().splitlines() == [
        f"{first} train.py x=1 trainer.threads=1",
        f"{first} train.py x=2 trainer.threads=1",
        f"{second} train.py x=3 trainer.threads=1",
    ]


PARALLEL_FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for train.py in a lane: logs its start and end around a pause, and the PYTHONPATH it got.
echo "start $* $PYTHONPATH" >> "$RUN_LOG"
sleep 2
echo "end $*" >> "$RUN_LOG"
"""


def test_jobs_run_lines_side_by_side_and_keep_the_callers_pythonpath(tmp_path):
    repo, first = _repo_with_the_script(tmp_path)
    fake = _fake_python(tmp_path, PARALLEL_FAKE_PYTHON)
    queue = tmp_path / "queue.txt"
    queue.write_text(f"{first} x=1\n{first} x=2\n{first} x=3\n")
    run_log = tmp_path / "runs.log"
    env = {**os.environ, "PY": str(fake), "RUN_LOG": str(run_log), "PYTHONPATH": "/carried/site"}
    subprocess.run(["bash", "scripts/run_queue.sh", str(queue), "1", "2"], cwd=repo, env=env, check=True,
                   capture_output=True, text=True, timeout=60)

    events = [line.split()[:3] for line in run_log.read_text().splitlines()]
    assert events[:2] == [["start", "train.py", "x=1"], ["start", "train.py", "x=2"]]  # two lanes at once
    assert sorted(e[2] for e in events if e[0] == "start") == ["x=1", "x=2", "x=3"]
    assert sorted(e[2] for e in events if e[0] == "end") == ["x=1", "x=2", "x=3"]
    assert events.index(["start", "train.py", "x=3"]) > 2  # the third waits for a free lane
    worktree_src = str(tmp_path / f"wt-{first}" / "src")
    assert all(line.endswith(f" {worktree_src}:/carried/site")
               for line in run_log.read_text().splitlines() if line.startswith("start"))


def test_jobs_must_be_a_positive_whole_number(tmp_path):
    queue = tmp_path / "queue.txt"
    queue.write_text("")
    out = subprocess.run(["bash", str(ROOT / "scripts" / "run_queue.sh"), str(queue), "1", "two"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "JOBS must be a positive whole number, got 'two'" in out.stderr
