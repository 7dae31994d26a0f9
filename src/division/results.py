"""Result files: written atomically (temp file + os.replace), one directory per run."""
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Dict

import torch

HASH_IGNORED = ("seed", "paths", "logger", "resume", "skip_done", "run_id", "exp_name")


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
    """Hash of the resolved config without seed, paths, logging and run bookkeeping: runs that differ only
    by seed share it, so tables can group seeds."""
    trimmed = {k: v for k, v in cfg.items() if k not in HASH_IGNORED}
    if isinstance(trimmed.get("trainer"), dict):
        trimmed["trainer"] = {k: v for k, v in trimmed["trainer"].items() if k != "progress"}
    blob = json.dumps(trimmed, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


def git_state(cwd=None):
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return sha, dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def versions() -> Dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("torchvision", "timm", "hydra", "omegaconf", "wandb", "numpy"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # an optional library may be missing or broken
            out[mod] = None
    return out


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
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
