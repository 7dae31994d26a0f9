import json
import subprocess
import sys

import pytest

from conftest import ROOT


def test_analysis_script_on_synthetic_data(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/analyze_frequency.py", "--synthetic", "--model", "resnet20",
                           "--batch", "8", "--draws", "1", "--train-epochs", "1", "--subset", "0",
                           "--out", str(tmp_path / "analysis"), "--work-dir", str(tmp_path), "--tag", "tiny"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "analysis" / "frequency_tiny.json").read_text())
    stage = next(iter(report["stages"].values()))
    assert set(stage["gradient"]) >= {"lfc_only", "hfc_only", "division@2", "per_channel@2", "division@2+relu_mask"}
    assert 0.0 <= min(v["8"] for v in stage["energy_share"].values()) <= 1.0
    assert stage["gradient"]["division@4"]["mean_rel_error"] < stage["gradient"]["division@1"]["mean_rel_error"]
    for name in ("frequency_tiny.md", "gradient_error_vs_bits_tiny.png", "lfc_energy_share_tiny.png"):
        assert (tmp_path / "analysis" / name).exists()


def test_recorded_command_holds_no_absolute_path():
    """Result files keep the command that made them with paths relative to the project root, never the
    machine's directory layout."""
    sys.path.insert(0, str(ROOT / "src"))
    from division import results
    out = ROOT / "results" / "analysis"
    cmd = results.command_line("scripts/x.py", ["--out", str(out), f"--data-root={ROOT.parent / 'shared'}", "--tag", "t"])
    assert cmd == "python scripts/x.py --out results/analysis --data-root=../shared --tag t"


def test_analysis_of_a_vit_checkpoint_on_synthetic_data(tmp_path):
    """The trained-network path on a ViT: token layers analysed, no ReLU-mask variants (a ViT has no ReLU),
    intervals over batches, summary and plots written."""
    import torch
    sys.path.insert(0, str(ROOT / "src"))
    from division.models import create_model
    torch.manual_seed(0)
    ckpt = tmp_path / "checkpoint.pt"
    torch.save({"model": create_model("vit_cifar").state_dict(), "epoch": 0}, ckpt)
    proc = subprocess.run([sys.executable, "scripts/analyze_frequency.py", "--synthetic", "--model", "vit_cifar",
                           "--checkpoint", str(ckpt), "--batches", "2", "--batch", "10", "--draws", "1",
                           "--out", str(tmp_path / "analysis"), "--tag", "vit"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "analysis" / "frequency_vit.json").read_text())
    stage = next(iter(report["stages"].values()))
    assert "blocks.0.attn.qkv" in stage["energy_share"] and "head" not in stage["energy_share"]
    assert not any(k.endswith("+relu_mask") for k in stage["gradient"])
    assert stage["gradient"]["division@2"]["mean_rel_error_ci95"] is not None
    assert "reuse_relu_mask does not apply" in (tmp_path / "analysis" / "frequency_vit.md").read_text()
    assert (tmp_path / "analysis" / "gradient_error_vs_bits_vit.png").exists()


def test_gradient_error_comparison_smoke(tmp_path):
    """compare_gradient_error on synthetic data: per method the mean, its interval, the paired difference and
    the per-layer errors, the first layer (whose input is the image) in its own column; and each method's
    activation compression on those batches (compact_relu: more than without it)."""
    proc = subprocess.run([sys.executable, "scripts/compare_gradient_error.py", "--synthetic", "--model", "resnet20",
                           "--batches", "2", "--per-class", "1", "--draws", "1", "--methods", "division", "actnn",
                           "division:compact_relu=true",
                           "--tag", "smoke", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gradient_error_smoke.json").read_text())
    rows = report["methods"]
    assert len(rows["division"]["layers"]) == 19 and rows["division"]["minus_baseline"] == 0.0
    assert 9 < rows["division"]["act_compression"] < rows["division:compact_relu=true"]["act_compression"]
    assert rows["division"]["options_minus_method"] is None
    pairs = zip(rows["division:compact_relu=true"]["per_batch"], rows["division"]["per_batch"])
    assert rows["division:compact_relu=true"]["options_minus_method"] == \
        pytest.approx(sum(a["rel_error"] - b["rel_error"] for a, b in pairs) / 2)
    assert "| method | rel. L2 error | 95 % CI | cosine | first layer (`conv1.weight`) |" in \
        (tmp_path / "gradient_error_smoke.md").read_text()


def test_welch_interval_known_values():
    """a = 1,2,3; b = 2,4,6: difference -2, standard error sqrt(1/3 + 4/3), Welch-Satterthwaite 2.94 degrees of
    freedom, taken as 2 (t = 4.303)."""
    import math
    from division.analysis import welch_interval
    diff, (lo, hi) = welch_interval([1, 2, 3], [2, 4, 6])
    half = 4.303 * math.sqrt(5 / 3)
    assert diff == -2 and lo == pytest.approx(-2 - half, abs=1e-3) and hi == pytest.approx(-2 + half, abs=1e-3)
    assert welch_interval([1.0], [2.0, 3.0]) == (-1.5, None)
