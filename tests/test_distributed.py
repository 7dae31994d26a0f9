import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONFIG_DIR, ROOT

SYN = ["data=synthetic", "model=resnet20", "data.batch_size=8", "data.train_size=64", "data.test_size=16",
       "logger=none", "trainer.progress=false", "trainer.device=cpu"]


def test_two_process_gloo_division(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29631",
           "train.py", *SYN, "method=division", "trainer.max_steps=2", "trainer.checkpoint_every_steps=1",
           f"paths.root_dir={tmp_path}"]  # a mid-epoch checkpoint after step 1: its sums are all-reduced
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(Path(tmp_path, "outputs", "runs").rglob("result.json"))
    assert len(files) == 1
    result = json.loads(files[0].read_text())
    assert result["status"] == "ok" and result["world_size"] == 2
    assert result["ddp_param_spread"] == 0.0
    assert result["epochs"][0]["train_images"] == 2 * 2 * 8  # 2 steps x 2 ranks x batch 8


def test_multirun_two_jobs(tmp_path):
    cmd = [sys.executable, "train.py", "-m", *SYN, "method=fp,division", "trainer.max_steps=1",
           f"paths.root_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(Path(tmp_path, "outputs", "runs").rglob("result.json"))
    assert len(files) == 2 and len({f.parent for f in files}) == 2


def test_slurm_launcher_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="hydra-submitit-launcher not installed (pip install -e '.[slurm]')")
    from hydra import compose as hydra_compose, initialize_config_dir
    with initialize_config_dir(version_base="1.3", config_dir=CONFIG_DIR):
        cfg = hydra_compose(config_name="train", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    assert cfg.hydra.launcher.gpus_per_node >= 1 and cfg.hydra.launcher.timeout_min > 0
