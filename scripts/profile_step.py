"""Where one training step's time goes: torch.profiler over a few steps of the runner's own train_step,
the top operators by device time written as text, with provenance in a JSON beside it.

    python scripts/profile_step.py --model resnet50 --method division --batch 256 --amp fp16 --device cuda
    python scripts/profile_step.py --model resnet50 --method division --batch 8 --amp none --device cpu --compile
"""
import argparse
from pathlib import Path

import torch

from division import api, engine, results
from division.methods import build, load_config
from division.models import create_model


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--method", default="division")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--amp", default="fp16", choices=list(engine.AMP_DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--compile", action="store_true", help="the model compiled as trainer.compile=true does")
    p.add_argument("--out", default=None, help="default: results/profile/<device>_<model>_<method>_b<batch>")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = create_model(args.model, num_classes=1000, image_size=args.image_size).to(device)
    method = build(load_config(args.method))
    method.prepare(model)
    if args.compile:
        api.compile_model(model, method)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    state = engine.StepState(device, amp=args.amp, scaler=scaler, progress=False)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    for _ in range(3):  # warm-up: kernels compiled, allocator grown
        engine.train_step(model, method, x, y, opt, None, state).loss.item()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        seconds = [engine.train_step(model, method, x, y, opt, None, state) for _ in range(args.steps)]
        seconds = [s.seconds for s in seconds]
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=args.rows)
    tag = results.device_tag(device)
    name = f"{tag}_{args.model}_{args.method}_b{args.batch}" + ("_compiled" if args.compile else "")
    base = Path(args.out or results.ROOT / "results" / "profile" / name)
    base.parent.mkdir(parents=True, exist_ok=True)
    text = base.with_suffix(".txt")
    tmp = text.with_suffix(".txt.tmp")
    tmp.write_text(table)
    tmp.replace(text)
    results.write_json(base.with_suffix(".json"), {
        "status": "ok", "model": args.model, "method": args.method, "batch_size": args.batch, "amp": args.amp,
        "image_size": args.image_size, "compiled": args.compile, "step_seconds": seconds,
        "table": results.relative_to_root(text),
        **results.provenance(device)})
    print(table)
    print(f"steps {', '.join(f'{s * 1e3:.1f} ms' for s in seconds)}; wrote {results.relative_to_root(text)}")


if __name__ == "__main__":
    main()
