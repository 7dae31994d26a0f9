import json
import subprocess
import sys

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
