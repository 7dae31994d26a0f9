"""Held bytes under method.budget: for each budget, the method calibrates on one batch, then one training step
on another batch is accounted like the runner's first step; writes results/budget/<model>_b<batch>_<method>.json
(budget, planned and held bytes, compression against plain autograd, each layer's choice). A measurement.

    python scripts/budget_fit.py --model resnet50 --batch 8 --budgets 12x,16x,20x
    python scripts/budget_fit.py --model resnet20 --batch 128 --image-size 32 --budgets 10.9x,15x,20x
"""
import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from division import engine, results
from division.methods import build, load_config
from division.models import create_model


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--method", default="division_plus")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--budgets", default="12x,16x,20x", help="comma-separated, as method.budget takes them")
    p.add_argument("--out", default=None, help="default: results/budget/<model>_b<batch>_<method>.json")
    return p.parse_args(argv)


def measure(args, budget: str, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = create_model(args.model, num_classes=10, image_size=args.image_size)
    if hasattr(model, "init_from_data"):
        model.init_from_data(torch.randn(64, 3, args.image_size, args.image_size))
    method = build({**load_config(args.method), "budget": budget})
    method.prepare(model)
    state = engine.StepState(torch.device("cpu"))
    shape = (args.batch, 3, args.image_size, args.image_size)
    calibration = torch.randn(shape), torch.randint(0, 10, (args.batch,))
    x, y = torch.randn(shape), torch.randint(0, 10, (args.batch,))
    start = time.perf_counter()
    plan = method.calibrate(model, engine._forward(model, *calibration, state))
    seconds = time.perf_counter() - start
    fp = method.fp_reference(model, engine._forward(model, x, y, state))
    with method.accounting(model) as acc:
        _, loss = engine._forward(model, x, y, state)()
    loss.backward()
    report = acc.report.use_fp_reference(fp)
    described = plan.describe()
    return {"budget": budget, "budget_bytes": plan.budget_bytes, "planned_bytes": plan.planned_bytes,
            "held_bytes": report.held_bytes, "held_of_budget": report.held_bytes / plan.budget_bytes,
            "fp_bytes": report.fp_bytes, "act_compression": report.ratio, "calibrate_seconds": seconds,
            "observe_seconds": plan.observe_seconds, "choices": dict(Counter(r["choice"] for r in described["layers"])),
            "est_rel_error_sum": described["est_rel_error_sum"], "layers": described["layers"]}


def main(argv=None):
    args = parse(argv)
    rows = []
    for budget in args.budgets.split(","):
        row = measure(args, budget)
        rows.append(row)
        print(f"{args.model} b{args.batch} {args.method} budget {budget}: held {row['held_bytes'] / 2**20:.2f} MiB of "
              f"{row['budget_bytes'] / 2**20:.2f} MiB ({100 * row['held_of_budget']:.2f} %), {row['act_compression']:.2f}x; "
              f"calibration {row['calibrate_seconds']:.1f} s; {row['choices']}", flush=True)
    out = Path(args.out or results.ROOT / "results" / "budget" / f"{args.model}_b{args.batch}_{args.method}.json")
    results.write_json(out, {"status": "ok", "model": args.model, "method": args.method, "batch_size": args.batch,
                             "image_size": args.image_size, "rows": rows, "threads": torch.get_num_threads(),
                             "command": results.command_line("scripts/budget_fit.py", argv or sys.argv[1:]),
                             **results.provenance(torch.device("cpu"))})
    print(f"wrote {results.relative_to_root(out)}")


if __name__ == "__main__":
    main()
