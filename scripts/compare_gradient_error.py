"""Weight-gradient error of methods against full precision on a trained network, over several disjoint
class-balanced test batches: per method the mean over the analysed layers (convolutions, and a ViT's linear
layers fed tokens) of the relative L2 error and cosine (each a mean over stochastic draws), with mean and
95 % t interval over batches, and the paired difference per batch against a baseline method (the first one
named), and for a method with options (``division:compact_relu=true``) against the same method without them
where that is listed too; beside it each method's activation compression on the same batches (held bytes
against plain autograd's, one training forward). A measurement, not a test.

    DATA_DIR=../shared/datasets python scripts/compare_gradient_error.py --model resnet20 \
        --checkpoint results/runs/cifar10_resnet20_full/<run>/checkpoint.pt --tag resnet20_full \
        --methods division division_plus division_plus:fuse_bn_relu=false division_plus:stat_dtype=fp32 \
                  division_plus:block_size=8 division_plus:small_map_elems=0
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from division import results  # noqa: E402
from division.analysis import (balanced_batches, cifar10_data_config, gradient_error,  # noqa: E402
                               held_compression, mean_interval, weight_grads)
from division.methods import build, load_config  # noqa: E402
from division.models import create_model  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet20")
    p.add_argument("--checkpoint", help="trained weights (a runner checkpoint.pt); omit only with --synthetic")
    p.add_argument("--methods", nargs="+", default=["division", "division_plus"])
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--per-class", type=int, default=13, help="images of each class per batch")
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--data-root")
    p.add_argument("--synthetic", action="store_true", help="random data and weights: a smoke run")
    p.add_argument("--random-init", action="store_true",
                   help="the model's initial weights (seed 0) on real test images: for a model with no trained "
                        "checkpoint here (ResNet-50 at 224); the report says so")
    p.add_argument("--image-size", type=int, default=0,
                   help="resize the 32x32 test images to this size (bilinear), e.g. 224 for ImageNet-shaped models")
    p.add_argument("--tag", default="resnet20")
    p.add_argument("--out", default=str(ROOT / "results" / "analysis"))
    args = p.parse_args(argv)
    if not args.checkpoint and not args.synthetic and not args.random_init:
        p.error("--checkpoint is required (or --random-init for initial weights, --synthetic for a smoke run)")
    if args.image_size < 0:
        p.error(f"--image-size={args.image_size} is invalid; 0 (keep 32) or a positive size")
    torch.manual_seed(0)
    model = create_model(args.model, num_classes=10)
    if args.checkpoint:
        model.load_state_dict(torch.load(args.checkpoint, map_location="cpu", weights_only=False)["model"])
    elif args.synthetic and hasattr(model, "init_from_data"):  # a smoke run: whitening from random images
        model.init_from_data(torch.randn(64, 3, 32, 32))
    batches = balanced_batches(cifar10_data_config(args.data_root, 200 if args.synthetic else 0), args.batches,
                               args.per_class)
    whitened = args.random_init and not args.checkpoint and hasattr(model, "init_from_data")
    if whitened:  # initial weights with a data-made first layer (fast94's whitening): from the analysed images
        model.init_from_data(torch.cat([x for x, _ in batches]))
    if args.image_size:
        batches = [(torch.nn.functional.interpolate(x, size=args.image_size, mode="bilinear", align_corners=False), y)
                   for x, y in batches]
    per_batch = {m: [] for m in args.methods}
    for i, (x, y) in enumerate(batches):
        reference = weight_grads(model.train(), x, y)
        other = batches[i - 1]  # a budgeted method plans from another batch than the one measured
        for spec in args.methods:
            config = load_config(spec)
            errs = gradient_error(model, build(config), x, y, args.draws, reference, calibration=other)
            per_batch[spec].append({"rel_error": statistics.mean(e["rel_error"] for e in errs.values()),
                                    "cosine": statistics.mean(e["cosine"] for e in errs.values()),
                                    "act_compression": held_compression(model, build(config), x, other),
                                    "layers": {n: e["rel_error"] for n, e in errs.items()}})
            print(f"batch {i} {spec:48s} rel. error {per_batch[spec][-1]['rel_error']:.4f}", flush=True)
    base = args.methods[0]
    rows = {}
    for spec, vals in per_batch.items():
        err, err_ci = mean_interval(v["rel_error"] for v in vals)
        cos, cos_ci = mean_interval(v["cosine"] for v in vals)
        diff, diff_ci = mean_interval(v["rel_error"] - b["rel_error"] for v, b in zip(vals, per_batch[base]))
        ratio, ratio_ci = mean_interval(v["act_compression"] for v in vals)
        plain = spec.partition(":")[0]
        own = own_ci = None
        if plain != spec and plain in per_batch:
            own, own_ci = mean_interval(v["rel_error"] - b["rel_error"] for v, b in zip(vals, per_batch[plain]))
        rows[spec] = {"per_batch": vals, "rel_error": err, "rel_error_ci95": err_ci, "cosine": cos,
                      "cosine_ci95": cos_ci, "minus_baseline": diff, "minus_baseline_ci95": diff_ci,
                      "act_compression": ratio, "act_compression_ci95": ratio_ci,
                      "options_minus_method": own, "options_minus_method_ci95": own_ci,
                      "layers": {n: statistics.mean(v["layers"][n] for v in vals) for n in vals[0]["layers"]}}
    first = next(iter(rows[base]["layers"]))  # the stem: its input is the image itself
    report = {"status": "ok", "model": args.model, "baseline": base, "batches": args.batches,
              "batch_size": int(batches[0][1].numel()), "draws": args.draws, "synthetic": args.synthetic,
              "weights": "checkpoint" if args.checkpoint else "random init (seed 0)" + (
                  ", whitening from the analysed test images" if whitened else ""),
              "image_size": args.image_size or 32,
              "checkpoint": results.relative_to_root(args.checkpoint) if args.checkpoint else None,
              "command": results.command_line("scripts/compare_gradient_error.py", argv or sys.argv[1:]),
              "methods": rows, **results.provenance(torch.device("cpu"))}
    out = Path(args.out)
    results.write_json(out / f"gradient_error_{args.tag}.json", report)
    fmt = lambda ci: "" if ci is None else f"[{ci[0]:.4f}, {ci[1]:.4f}]"  # noqa: E731
    weights = "" if args.checkpoint else ", initial weights (seed 0, untrained)"
    size = f" at {args.image_size}x{args.image_size}" if args.image_size else ""
    lines = [f"Weight-gradient error vs full precision, {args.model}{weights}, {args.batches} class-balanced test batches{size} of "
             f"{report['batch_size']}, {args.draws} draws each; mean over the analysed layers (convolutions; a "
             "ViT's token linear layers too); 95 % t intervals over batches.",
             "", f"| method | rel. L2 error | 95 % CI | cosine | first layer (`{first}`) | minus {base} (paired) | 95 % CI "
             "| minus the method without its options (paired) | 95 % CI | act. compression (these batches) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for spec, r in rows.items():
        lines.append(f"| {spec} | {r['rel_error']:.4f} | {fmt(r['rel_error_ci95'])} | {r['cosine']:.4f} | "
                     f"{r['layers'][first]:.4f} | {r['minus_baseline']:+.4f} | {fmt(r['minus_baseline_ci95'])} | "
                     + ("- | - | " if r["options_minus_method"] is None else
                        f"{r['options_minus_method']:+.4f} | {fmt(r['options_minus_method_ci95'])} | ")
                     + f"{r['act_compression']:.2f}x |")
    results.write_text(out / f"gradient_error_{args.tag}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
