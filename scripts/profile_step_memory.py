"""Per-phase memory profile of one training step (the second, when the optimizer state exists): resident
memory (CPU, glibc returning freed blocks) or allocated memory (CUDA) after every leaf module's forward and
once its output's gradient exists, and where the step's peak rose, to see what sets a method's peak.

    python scripts/profile_step_memory.py --model resnet50 --method division --batch 32 [--out FILE]
"""
import argparse
import sys
from pathlib import Path

import torch

from division import engine, methods, results
from division.peak import PeakMeter, release_freed_memory
from division.models import create_model


def profile(model_name, method_spec, batch, image_size, num_classes=1000, device_name="cpu"):
    device = torch.device(device_name)
    if device.type == "cpu":
        release_freed_memory()
    meter = PeakMeter(device)
    torch.manual_seed(0)
    phases = [("start", meter.current())]
    model = create_model(model_name, num_classes=num_classes, stem="auto", image_size=image_size).to(device)
    method = methods.build(methods.load_config(method_spec))
    method.prepare(model)
    phases.append(("model built", meter.current()))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    y = torch.randint(0, num_classes, (batch,), device=device)
    state = engine.StepState(device)
    phases.append(("inputs", meter.current()))
    engine.train_step(model, method, x, y, opt, None, state)  # the optimizer state exists from here on
    phases.append(("after a first step (optimizer state)", meter.current()))
    trace = []
    for name, m in model.named_modules():
        if next(m.children(), None) is None:
            m.register_forward_hook(lambda mod, a, o, n=name: mark(n, o))

    def mark(name, out):
        trace.append(("fwd " + name, meter.current(), meter.peak()))
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # the gradient of this output exists: the backward of the layers after it has run
            out.register_hook(lambda g: trace.append(("bwd after " + name, meter.current(), meter.peak())))
    meter.reset()
    engine.train_step(model, method, x, y, opt, None, state, account=True)
    peak = meter.peak()
    phases.append(("after the profiled step", meter.current()))
    return phases, trace, peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--method", default="division")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--device", default="cpu")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--out", default=None, help="write the profile as JSON")
    args = p.parse_args(argv)
    phases, trace, peak = profile(args.model, args.method, args.batch, args.image_size, device_name=args.device)
    mib = 2 ** 20
    lines = [f"{args.model} {args.method} batch {args.batch} {args.image_size}x{args.image_size} on {args.device}"]
    lines += [f"  {name:42s} {v / mib:9.1f} MiB" for name, v in phases]
    lines.append(f"  peak of the profiled step {peak / mib:9.1f} MiB")
    fwd_end = next((v for n, v, _ in reversed(trace) if n.startswith("fwd")), 0)
    lines.append(f"  end of forward {fwd_end / mib:9.1f} MiB")
    lines.append("  where the peak rose (resident memory at the hook, peak so far, rise of the peak):")
    rises, last = [], phases[-2][1]
    for name, current, peak_so_far in trace:
        rises.append((peak_so_far - last, name, current, peak_so_far))
        last = max(last, peak_so_far)
    for rise, name, current, peak_so_far in sorted(rises, reverse=True)[:args.top]:
        lines.append(f"    {name:46s} {current / mib:8.1f} {peak_so_far / mib:8.1f} {rise / mib:+8.1f} MiB")
    print("\n".join(lines))
    if args.out:
        results.write_json(args.out, {"model": args.model, "method": args.method, "batch": args.batch,
                                      "image_size": args.image_size, "phases": phases, "peak_bytes": peak,
                                      "trace": trace, **results.provenance(torch.device(args.device))})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    main()
