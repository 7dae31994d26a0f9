"""Result files: written atomically (temp file + os.replace), one directory per run."""
import hashlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any, Dict

import torch

HASH_IGNORED = ("seed", "paths", "logger", "resume", "skip_done", "run_id", "exp_name", "accept_stale")


def write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: readers see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", newline="") as fh:
        fh.write(text)
    os.replace(tmp, path)


def write_json(path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_jsonl(path, rows) -> None:
    write_text(path, "".join(json.dumps(row, default=str) + "\n" for row in rows))


def read_json(path):
    with open(path) as fh:
        return json.load(fh)


def config_hash(cfg: Dict) -> str:
    """Hash of the resolved config without seed, paths, logging, run bookkeeping, execution details
    (threads, progress bar, allocator setting, mid-epoch checkpoints) and where the data is read from
    (``data.root``, ``data.cache_dir``, ``data.download``): runs that differ only by seed share it, so tables
    can group seeds, and a sweep finds its runs whatever thread count it is given and from whichever folder
    it reaches the dataset (a worktree one level deeper sees ``../../data`` for ``../data``)."""
    trimmed = {k: v for k, v in cfg.items() if k not in HASH_IGNORED}
    if isinstance(trimmed.get("trainer"), dict):  # how a run executes, not what it computes
        trimmed["trainer"] = {k: v for k, v in trimmed["trainer"].items()
                              if k not in ("progress", "threads", "release_freed_memory", "checkpoint_every_steps")}
    if isinstance(trimmed.get("data"), dict):  # where the same data is found, not what it is
        trimmed["data"] = {k: v for k, v in trimmed["data"].items() if k not in ("root", "cache_dir", "download")}
    blob = json.dumps(trimmed, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


def git_state(cwd=None):
    """(HEAD's commit, whether tracked files outside ``results/`` differ from it). Results are outputs: a suite
    rerun over committed result files changes them as it goes, and that must not mark its later rows dirty."""
    if os.environ.get("DIVISION_GIT_SHA"):
        # a copy of the working tree sent to another machine (the GPU recipe): the commit it was copied from, as
        # recorded before it left (scripts/device/prepare.sh). It wins over a .git found there, which can be an
        # older snapshot of the repository than the tree that travelled; provenance() checks the code hash.
        return os.environ["DIVISION_GIT_SHA"], os.environ.get("DIVISION_GIT_DIRTY", "true") == "true"
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/",
                                     ":(top,exclude)results"], cwd=cwd,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return sha, dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def _project_root() -> Path:
    """The checkout this package runs from (``src/division`` inside it); for an installed wheel, the working
    directory: results, and the paths stored in them, are then the user's."""
    checkout = Path(__file__).resolve().parents[2]
    return checkout if (checkout / "pyproject.toml").exists() and (checkout / "src" / "division").is_dir() \
        else Path.cwd()


ROOT = _project_root()
PACKAGE_DIR = Path(__file__).resolve().parent


def code_version(package: Path = PACKAGE_DIR) -> str:
    """Hash of the code that decides a result: the package's sources and the configs (not docs, not results).
    Unlike the commit, it does not change when only documentation or results are committed, and it does
    change with uncommitted edits."""
    h = hashlib.sha1()
    files = sorted(f for ext in ("py", "c", "h", "yaml") for f in package.rglob(f"*.{ext}"))
    for f in files:
        h.update(str(f.relative_to(package)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def provenance(device: torch.device, code: str = None) -> Dict[str, Any]:
    """What every result file records: commit, dirty flag, code version (computed unless given), library
    versions, device."""
    sha, dirty = git_state(ROOT)
    code = code or code_version()
    recorded = os.environ.get("DIVISION_CODE_VERSION")
    if recorded and recorded != code:  # the code that ran is not the recorded commit's
        dirty = True
    return {"git_sha": sha, "git_dirty": dirty, "code_version": code, "versions": versions(),
            "device": device_description(device)}


def portable(obj):
    """A resolved config with absolute paths rewritten relative to the project root (``../shared/...`` for
    paths beside it), so committed results carry no machine's directory layout."""
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v) for v in obj]
    if isinstance(obj, str) and os.path.isabs(obj):
        return os.path.relpath(obj, ROOT)
    return obj


def command_line(script: str, argv) -> str:
    """The command that made a result, for the file: absolute paths among the arguments (``/x`` or
    ``--flag=/x``) stored as ``portable`` stores them."""
    def one(arg: str) -> str:
        flag, eq, value = arg.partition("=")
        if eq and os.path.isabs(value):
            return f"{flag}={portable(value)}"
        return portable(arg)
    return " ".join(["python", script, *map(one, argv)])


def relative_to_root(path) -> str:
    """A path as stored in committed results: relative to the project root when inside it."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def versions() -> Dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("torchvision", "timm", "hydra", "omegaconf", "wandb", "numpy"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # an optional library may be missing or broken
            out[mod] = None
    return out


def device_tag(device: torch.device) -> str:
    """A file-name-safe name of the device: the GPU's name (``nvidia_h200``), or ``cpu``."""
    if device.type != "cuda":
        return device.type
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        conv = "TF32" if torch.backends.cudnn.allow_tf32 else "fp32"
        matmul = "TF32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
        return f"cuda: {torch.cuda.get_device_name(device)} (convolutions {conv}, matmuls {matmul})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu: {cpu}, {os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads"
