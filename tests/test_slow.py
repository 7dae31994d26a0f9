"""Long checks, out of the default run: ``make test-slow`` runs them (about 2 minutes, 4 GB of memory)."""
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT


def _train(tmp_path, method, batch):
    cmd = [sys.executable, "train.py", "data=synthetic", "model=resnet50", f"method={method}",
           f"data.batch_size={batch}", "trainer.max_steps=1", "trainer.progress=false", "trainer.device=cpu",
           f"paths.root_dir={tmp_path / method}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(next(Path(tmp_path / method).rglob("result.json")).read_text())


@pytest.mark.slow
def test_division_whole_process_peak_is_its_own(tmp_path):
    """train.py end to end, resnet50 at 224x224, batch 32, one step: the whole process's peak resident set
    with DIVISION is far below full precision's (the reference forward holds nothing), and the runner's
    step peak agrees with what the operating system saw."""
    div = _train(tmp_path, "division", 32)
    div_os = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    fp = _train(tmp_path, "fp", 32)
    fp_os = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # max over children: fp's
    assert fp["act_mem_fp_bytes"] == div["act_mem_fp_bytes"]
    assert 640 * 2**20 * 4 < fp["act_mem_fp_bytes"] < 680 * 2**20 * 4
    assert fp_os / div_os > 2.0, (fp_os, div_os)
    for r, seen in ((div, div_os), (fp, fp_os)):
        assert r["peak_mem_bytes"] <= seen * 1.01
