"""What an offline W&B run holds, read from its .wandb file without syncing: per-step points, per-epoch
metrics, tables, the config, the run's name and group.

    python scripts/wandb_summary.py outputs/wandb/offline-run-*      # one or more run folders
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from division.loggers import read_offline_run  # noqa: E402


def summarize(run_dir: Path) -> dict:
    history, config, run = read_offline_run(run_dir)
    steps = [h for h in history if "step/train_loss" in h]
    epochs = [h for h in history if "top1" in h]
    tables = sorted({k[:-len("/_type")] for h in history for k, v in h.items() if k.endswith("/_type") and v == "table-file"})
    return {
        "run": run, "history_rows": len(history),
        "per_step_points": len(steps), "per_step_keys": sorted({k for h in steps for k in h if k.startswith("step/")}),
        "first_step": steps[0] if steps else None, "last_step": steps[-1] if steps else None,
        "per_epoch_rows": [{k: h.get(k) for k in ("_step", "train_loss", "top1", "act_compression", "throughput_img_s")}
                           for h in epochs],
        "tables": tables,
        "config": {k: (config[k].get("name") if isinstance(config[k], dict) else config[k]) for k in sorted(config)},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="offline-run-* folders")
    args = parser.parse_args()
    for run_dir in args.runs:
        if not any(run_dir.glob("*.wandb")):
            raise SystemExit(f"error: {run_dir} holds no .wandb file; pass an offline-run-* folder")
        print(json.dumps({"dir": str(run_dir), **summarize(run_dir)}, indent=1, default=str))


if __name__ == "__main__":
    main()
