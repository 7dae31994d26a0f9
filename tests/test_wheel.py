"""The package as a user installs it: the wheel built from this checkout, installed into a fresh virtual
environment outside it, then ``division.prepare`` on a torchvision model for one step and ``division-train``
for one step, from a temporary folder. Slow (a fresh environment installs torch):

    make test-wheel                         # Python 3.11 and 3.12 where they are installed
    make test-wheel WHEEL_PYTHONS=3.11
"""
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow
# torch and torchvision per Python version: the measured pins (constraints.txt) where they are built, the
# GPU image's versions on 3.12
TORCH = {"3.11": ["-c", str(ROOT / "constraints.txt")], "3.12": ["torch==2.11.0", "torchvision==0.26.0"],
         "3.13": ["torch==2.11.0", "torchvision==0.26.0"]}

LIBRARY_STEP = """
import torch, torch.nn.functional as F, torchvision
import division
model = torchvision.models.resnet18(num_classes=10)
handle = division.prepare(model, method="division")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,))
loss = F.cross_entropy(model(x), y)
loss.backward(); opt.step()
report = handle.memory_report()
assert torch.isfinite(loss) and report.ratio > 5, report.ratio
assert "site-packages" in division.__file__, division.__file__
print(f"library step ok: {report.ratio:.2f}x, from {division.__file__}")
"""


def _python(version: str):
    """An interpreter of that version: on PATH, or under pyenv; None if there is none."""
    candidates = [shutil.which(f"python{version}"), *sorted(glob.glob(os.path.expanduser(
        f"~/.pyenv/versions/{version}*/bin/python{version}")))]
    for exe in filter(None, candidates):
        if subprocess.run([exe, "--version"], capture_output=True).returncode == 0:
            return exe
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)], check=True)
    (built,) = dist.glob("division-*.whl")
    return built


@pytest.mark.parametrize("version", os.environ.get("DIVISION_WHEEL_PYTHONS", "3.11").split())
def test_wheel_outside_the_checkout(version, wheel, tmp_path):
    exe = _python(version)
    if exe is None:
        pytest.skip(f"no Python {version} on this machine")
    env_dir, work = tmp_path / "env", tmp_path / "work"
    work.mkdir()
    subprocess.run([exe, "-m", "venv", str(env_dir)], check=True)
    pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [f"{wheel}[train]", *TORCH.get(version, [])], check=True, cwd=work)
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    lib = subprocess.run([str(env_dir / "bin" / "python"), "-c", LIBRARY_STEP], cwd=work, env=clean_env,
                         capture_output=True, text=True)
    assert lib.returncode == 0, lib.stderr[-3000:]
    train = subprocess.run([str(env_dir / "bin" / "division-train"), "data=synthetic", "model=resnet20",
                            "method=division", "trainer.max_steps=1", "trainer.epochs=1", "data.batch_size=4",
                            "data.train_size=8", "data.test_size=4", "trainer.device=cpu", "logger=none",
                            "trainer.progress=false"], cwd=work, env=clean_env, capture_output=True, text=True)
    assert train.returncode == 0, train.stderr[-3000:]
    assert list(work.glob("outputs/runs/**/result.json")), sorted(str(p) for p in work.rglob("*"))[:50]
