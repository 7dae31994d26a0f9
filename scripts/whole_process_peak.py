"""Whole-process peak memory of ``train.py`` end to end, per method, as the operating system sees it
(the child's peak resident set, as ``/usr/bin/time -v`` reports it), beside the runner's own step peak and
activation bytes. One fresh process per method; ratios are taken within one invocation.

    python scripts/whole_process_peak.py --model resnet50 --batch 32 --methods fp,division
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from division import results  # noqa: E402


def run_method(model: str, method: str, batch: int, steps: int) -> dict:
    """train.py in a child process; its peak RSS from wait4 (the same figure /usr/bin/time -v prints)."""
    args = ["data=synthetic", f"model={model}", f"method={method}", f"data.batch_size={batch}",
            f"trainer.max_steps={steps}", "trainer.progress=false"]
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "log.txt", "w+") as log:
        proc = subprocess.Popen([sys.executable, "train.py", *args, f"paths.root_dir={tmp}"], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            log.seek(0)
            raise SystemExit(f"{method}: train.py failed:\n{log.read()[-2000:]}")
        run = json.loads(next(Path(tmp).rglob("result.json")).read_text())
    return {"method": method, "command": results.command_line("train.py", args),
            "process_peak_rss_bytes": usage.ru_maxrss * 1024,
            "run": {k: run.get(k) for k in ("act_mem_bytes", "act_mem_fp_bytes", "act_compression", "peak_mem_bytes",
                                            "peak_mem_how", "codec_backends", "input_size")}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--methods", default="fp,division")
    p.add_argument("--out", default=None, help="default results/peak/<model>_b<batch>.json")
    args = p.parse_args(argv)
    rows = []
    for method in args.methods.split(","):
        row = run_method(args.model, method, args.batch, args.steps)
        rows.append(row)
        print(f"{method:12s} process peak {row['process_peak_rss_bytes'] / 2**20:8.0f} MiB"
              f"  step peak {row['run']['peak_mem_bytes'] / 2**20:8.0f} MiB  activations "
              f"{row['run']['act_mem_bytes'] / 2**20:8.1f} of {row['run']['act_mem_fp_bytes'] / 2**20:8.1f} MiB", flush=True)
    fp = next((r for r in rows if r["method"] == "fp"), None)
    for r in rows:
        if fp:
            r["process_peak_ratio_fp_over_method"] = round(fp["process_peak_rss_bytes"] / r["process_peak_rss_bytes"], 4)
            print(f"fp / {r['method']}: {r['process_peak_ratio_fp_over_method']:.3f}x")
    out = Path(args.out or ROOT / "results" / "peak" / f"{args.model}_b{args.batch}.json")
    import torch
    results.write_json(out, {"status": "ok", "model": args.model, "batch_size": args.batch, "steps": args.steps,
                             "rows": rows, **results.provenance(torch.device("cpu"))})
    print(f"wrote {results.relative_to_root(out)}")


if __name__ == "__main__":
    main()
