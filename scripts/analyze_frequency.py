"""Frequency analysis of activations and gradients: does backward mainly use the LFC?

For a model and a batch of real data (default: CIFAR ResNet-18 on CIFAR-10, at initialisation and after a
short training whose checkpoint is kept), for every convolution input (and, in a ViT, every linear layer's
token input, as the maps on the patch grid that DIVISION's codec sees) it measures the LFC's share of the
activation energy (B = 2, 4, 8, 16), the reconstruction error of DIVISION, per-channel and per-group
quantizers at 1, 2 and 4 bits, and the weight-gradient error (relative L2, cosine; mean over stochastic
draws) when backward uses the LFC alone, the HFC alone, LFC + b-bit HFC, or a plain b-bit quantizer, each
with and without reuse_relu_mask, and DIVISION at 2 bits for each block size, beside the bits per element
each variant holds.

    DATA_DIR=../shared/datasets python scripts/analyze_frequency.py
        # the committed run: ~12 min on 2 CPUs, ~7 min when the trained checkpoint already exists
    python scripts/analyze_frequency.py --replot                                 # plots and summary from the JSON
    python scripts/analyze_frequency.py --synthetic --model resnet20 --tag tiny  # smoke run, no data needed
"""
import argparse
import json
import os
import statistics
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from division import CONFIG_DIR, results  # noqa: E402
from division.analysis import (CodecMethod, gradient_error, hfc_only, layer_inputs, lfc_energy_share,  # noqa: E402
                               lfc_only, mean_interval, mean_over_layers, relative_error, weight_grads)
from division.codecs import DivisionCodec, GroupwiseCodec, PerChannelCodec  # noqa: E402
from division.models import create_model  # noqa: E402

BLOCKS = (2, 4, 8, 16)
BITS = (1, 2, 4)


def codecs_at(bits):
    return {"division": DivisionCodec(8, bits), "per_channel": PerChannelCodec(bits),
            "per_group": GroupwiseCodec(bits, 256)}


def bits_per_element(codec, acts):
    held = sum(codec.encode(a).nbytes() for a in acts.values())
    return 8.0 * held / sum(a.numel() for a in acts.values())


def lfc_bits_per_element(acts, block: int) -> float:
    """Bits per element the bf16 LFC alone holds, blocks shrunk to the side of small maps counted as such."""
    from division.codecs.division import lfc_blocks
    held = total = 0
    for a in acts.values():
        n, c, h, w = a.shape
        bh, bw = lfc_blocks(h, w, block)
        held += n * c * -(-h // bh) * -(-w // bw) * 16
        total += a.numel()
    return held / total


def analyse(model, x, y, draws, seed):
    torch.manual_seed(seed)
    acts = layer_inputs(model, x)
    energy = {name: {str(b): lfc_energy_share(a, b) for b in BLOCKS} for name, a in acts.items() if a.dim() == 4}
    recon = {}
    for bits in BITS:
        for cname, codec in codecs_at(bits).items():
            per_layer = {n: statistics.mean(relative_error(codec.encode(a).decode(), a) for _ in range(draws))
                         for n, a in acts.items()}
            recon[f"{cname}@{bits}"] = {"bits_per_element": bits_per_element(codec, acts),
                                        "mean_rel_error": statistics.mean(per_layer.values()), "layers": per_layer}
    variants = {"lfc_only": (lfc_only(8), lfc_bits_per_element(acts, 8)), "hfc_only": (hfc_only(8), 32.0)}
    for bits in BITS:
        codecs = codecs_at(bits)
        variants[f"division@{bits}"] = (codecs["division"].encode, bits_per_element(codecs["division"], acts))
        variants[f"per_channel@{bits}"] = (codecs["per_channel"].encode, bits_per_element(codecs["per_channel"], acts))
    for block in BLOCKS:
        if block != 8:  # the block-size sweep at 2 bits, without the ReLU mask
            codec = DivisionCodec(block, 2)
            variants[f"division@2,B={block}"] = (codec.encode, bits_per_element(codec, acts))
    reference = weight_grads(model.train(), x, y)
    has_relu = any(isinstance(m, torch.nn.ReLU) for m in model.modules())  # else reuse_relu_mask changes nothing
    grads = {}
    for vname, (encode, bpe) in variants.items():
        for reuse in ((False,) if ",B=" in vname or not has_relu else (False, True)):
            torch.manual_seed(seed)
            errs = gradient_error(model, CodecMethod(encode, vname, reuse_relu_mask=reuse), x, y, draws, reference)
            grads[f"{vname}{'+relu_mask' if reuse else ''}"] = {
                "bits_per_element": bpe, "reuse_relu_mask": reuse,
                "mean_rel_error": mean_over_layers(errs, "rel_error"), "mean_cosine": mean_over_layers(errs, "cosine"),
                "layers": errs}
    return {"energy_share": energy, "reconstruction": recon, "gradient": grads}




def trained_model(args):
    """Train briefly with the project's runner (method fp) and return the model with that checkpoint."""
    from division.train import run
    from hydra import compose, initialize_config_dir
    overrides = [f"model={args.model}", "method=fp", f"trainer.epochs={args.train_epochs}", "logger=none",
                 "trainer.progress=false", "exp_name=analysis", f"data.subset={args.subset}", "trainer.device=cpu",
                 f"paths.root_dir={args.work_dir}", f"data.test_subset={args.test_subset}",
                 f"optim.lr={args.lr}", "optim.warmup_epochs=1", "paths.runs_dir=${paths.results_dir}/runs",
                 "accept_stale=true"]  # the trained network is the subject of the analysis, not a result
    if args.synthetic:
        overrides += ["data=synthetic", "data.train_size=64", "data.test_size=32", "data.batch_size=16"]
    elif args.data_root:
        overrides += [f"data.root={args.data_root}"]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        cfg = compose(config_name="train", overrides=overrides + ["skip_done=true"])
    result = run(cfg)
    ckpt = Path(cfg.paths.runs_dir) / "analysis" / result["run_id"] / "checkpoint.pt"
    if not ckpt.exists():  # a committed result.json without its (untracked) checkpoint: train again
        cfg.skip_done = False
        result = run(cfg)
    model = create_model(args.model, num_classes=int(cfg.model.num_classes))
    model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=False)["model"])
    return model, str(ckpt), result


def real_batch(args):
    """``args.batch`` test images drawn at random from a class-stratified subset (the test loader is
    ordered by class, so its first batch would hold one class only)."""
    from division import data as data_lib
    from hydra import compose, initialize_config_dir
    overrides = ["data.subset=10"]
    if args.data_root:
        overrides.append(f"data.root={args.data_root}")
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        cfg = compose(config_name="train", overrides=overrides)
    cfg.data.test_subset = -(-args.batch // int(cfg.data.num_classes))
    _, test, _ = data_lib.build(cfg.data)
    xs, ys = zip(*test)
    x, y = torch.cat(xs), torch.cat(ys)
    pick = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))[:args.batch]
    return x[pick], y[pick]


def plots(out, tag, report):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    stages = report["stages"]  # initialisation and short training, or one trained checkpoint
    fig, axes = plt.subplots(1, len(stages), figsize=(5.5 * len(stages), 4), squeeze=False)
    for (stage, figures), ax in zip(stages.items(), axes[0]):
        g = figures["gradient"]
        for family, marker in (("division", "o"), ("per_channel", "s")):
            for reuse in (False, True):
                keys = [f"{family}@{b}{'+relu_mask' if reuse else ''}" for b in BITS]
                if any(k not in g for k in keys):  # a model without ReLU: no mask variants
                    continue
                pts = [(g[k]["bits_per_element"], g[k]["mean_rel_error"]) for k in keys]
                ax.plot(*zip(*pts), marker=marker, linestyle="--" if reuse else "-",
                        label=f"{family}{' + relu mask' if reuse else ''}")
        for k, marker in (("lfc_only", "^"), ("hfc_only", "v")):
            for suffix, face in (("", None), ("+relu_mask", "none")):
                if k + suffix not in g:
                    continue
                point = g[k + suffix]
                ax.scatter([point["bits_per_element"]], [point["mean_rel_error"]], marker=marker,
                           facecolors=face, edgecolors="C3" if k == "lfc_only" else "C4",
                           color=None if face else ("C3" if k == "lfc_only" else "C4"), label=k + suffix)
        sweep = [(f"division@2,B={b}" if b != 8 else "division@2", b) for b in BLOCKS]
        for key, block in sweep:
            ax.annotate(f"B={block}", (g[key]["bits_per_element"], g[key]["mean_rel_error"]), fontsize=6,
                        textcoords="offset points", xytext=(4, -8))
        ax.scatter([g[k]["bits_per_element"] for k, _ in sweep], [g[k]["mean_rel_error"] for k, _ in sweep],
                   marker="x", color="C0", label="division@2, block sweep")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bits per element held")
        ax.set_ylabel("weight-gradient relative L2 error (mean over layers)")
        ax.set_title(textwrap.fill(f"{report['model']} — {stage}", 70), fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"gradient_error_vs_bits_{tag}.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(11, 4))
    for stage in report["stages"]:
        e = report["stages"][stage]["energy_share"]
        names = list(e)
        for b in ("2", "8"):
            ax.plot(range(len(names)), [e[n][b] for n in names], marker=".", label=f"{stage}, B={b}")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=90, fontsize=6)
    ax.set_ylabel("LFC share of activation energy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"lfc_energy_share_{tag}.png", dpi=110)
    plt.close(fig)


def _ci(entry, key):
    ci = entry.get(key + "_ci95")
    return f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else ""


def summary(report) -> str:
    batches = report.get("batches", 1)
    lines = [f"# Frequency analysis: {report['model']} ({report['data']})", "",
             f"{batches} batch(es) of {report['batch']} images; gradient errors are means over the analysed layers "
             "(convolutions; a ViT's linear layers too) and "
             f"{report['draws']} stochastic draws" + (", then over batches with a 95 % t interval" if batches > 1
                                                       else "") +
             f". Generated by `scripts/analyze_frequency.py` from `{report['json']}`.", ""]
    for stage, s in report["stages"].items():
        e = s["energy_share"]
        if "energy_share_mean" in s:
            shares = ", ".join(f"B={b}: {v['mean']:.3f}" + (f" [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]" if v["ci95"]
                                                              else "") for b, v in s["energy_share_mean"].items())
        else:
            shares = ", ".join(f"B={b}: {statistics.mean(v[str(b)] for v in e.values()):.3f}" for b in BLOCKS)
        lines += [f"## {stage}", "", "LFC share of activation energy (mean over layer inputs): " + shares, "",
                  "| variant | bits/element | grad rel. error | 95 % CI | grad cosine |", "|---|---|---|---|---|"]
        for k, g in s["gradient"].items():
            lines.append(f"| {k} | {g['bits_per_element']:.2f} | {g['mean_rel_error']:.4f} | "
                         f"{_ci(g, 'mean_rel_error')} | {g['mean_cosine']:.4f} |")
        lines += ["", "| codec | bits/element | activation rel. error | 95 % CI |", "|---|---|---|---|"]
        for k, r in s["reconstruction"].items():
            lines.append(f"| {k} | {r['bits_per_element']:.2f} | {r['mean_rel_error']:.4f} | {_ci(r, 'mean_rel_error')} |")
        g = s["gradient"]
        lines += ["", "Reading: at 2 bits DIVISION's gradient error is "
                  f"{g['division@2']['mean_rel_error']:.4f} vs {g['per_channel@2']['mean_rel_error']:.4f} for the "
                  f"plain per-channel quantizer ({g['division@2']['bits_per_element']:.2f} vs "
                  f"{g['per_channel@2']['bits_per_element']:.2f} bits/element); backward from the LFC alone gives "
                  f"{g['lfc_only']['mean_rel_error']:.4f}, from the HFC alone {g['hfc_only']['mean_rel_error']:.4f}. "
                  + (f"With the ReLU mask reused, DIVISION@2 gives {g['division@2+relu_mask']['mean_rel_error']:.4f}."
                     if "division@2+relu_mask" in g else "The model has no ReLU: reuse_relu_mask does not apply.")]
        if "mean_rel_error_per_batch" in g["division@2"]:
            for bits in BITS:
                a, b = g[f"division@{bits}"], g[f"per_channel@{bits}"]
                diff, ci = mean_interval(x - y for x, y in zip(a["mean_rel_error_per_batch"],
                                                               b["mean_rel_error_per_batch"]))
                lines.append(f"DIVISION@{bits} minus per-channel@{bits}, paired by batch: {diff:+.4f}" +
                             (f" (95 % CI [{ci[0]:+.4f}, {ci[1]:+.4f}])" if ci else "") +
                             f" at {a['bits_per_element']:.2f} vs {b['bits_per_element']:.2f} bits/element.")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--data-root", default=os.environ.get("DATA_DIR"))
    p.add_argument("--synthetic", action="store_true", help="random data (tests); no real CIFAR-10 needed")
    p.add_argument("--batch", type=int, default=200, help="real test images analysed (all classes)")
    p.add_argument("--draws", type=int, default=2)
    p.add_argument("--train-epochs", type=int, default=4)
    p.add_argument("--subset", type=int, default=100, help="training images per class for the short training")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate of the short training (per 128 images)")
    p.add_argument("--test-subset", type=int, default=50, help="test images per class for the short training")
    p.add_argument("--out", default=str(ROOT / "results" / "analysis"))
    p.add_argument("--work-dir", default=".", help="paths.root_dir of the short training run")
    p.add_argument("--tag", default=None)
    p.add_argument("--replot", action="store_true", help="only redraw the plots and summary from the JSON")
    p.add_argument("--checkpoint", help="analyse this trained network (a runner checkpoint.pt) instead of the "
                                        "initialisation and a short training")
    p.add_argument("--batches", type=int, default=1, help="disjoint class-balanced test batches of --batch images; "
                                                           "with more than one, every figure gets a 95 %% t interval")
    args = p.parse_args(argv)
    tag = args.tag or f"{args.model}_{'synthetic' if args.synthetic else 'cifar10'}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        write_outputs(out, tag, json.loads((out / f"frequency_{tag}.json").read_text()))
        return
    if args.checkpoint:
        return analyse_checkpoint(args, out, tag)
    if args.synthetic:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(args.batch, 3, 32, 32, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    else:
        x, y = real_batch(args)
    torch.manual_seed(0)
    init = create_model(args.model)
    trained, ckpt, run = trained_model(args)
    json_path = out / f"frequency_{tag}.json"
    report = {"model": args.model, "data": "synthetic" if args.synthetic else "cifar10 (JPEG copy)",
              "batch": int(x.shape[0]), "draws": args.draws, "checkpoint": results.relative_to_root(ckpt),
              **results.provenance(torch.device("cpu")),
              "trained": {"epochs": args.train_epochs, "subset_per_class": args.subset, "top1": run.get("top1")},
              "json": json_path.name,
              "stages": {"initialisation": analyse(init, x, y, args.draws, 0),
                         f"after {args.train_epochs} epochs (top-1 {run.get('top1', 0):.1f}%)": analyse(trained, x, y, args.draws, 0)}}
    results.write_json(json_path, report)
    print(write_outputs(out, tag, report))


def _aggregate(per_batch):
    """Figures of several batches -> the same structure holding means, plus ``*_ci95`` intervals and
    ``per_batch`` values for every scalar the summary and plots read."""
    first = per_batch[0]
    energy = {n: {b: statistics.mean(r["energy_share"][n][b] for r in per_batch) for b in first["energy_share"][n]}
              for n in first["energy_share"]}
    shares = {b: [statistics.mean(v[b] for v in r["energy_share"].values()) for r in per_batch]
              for b in next(iter(first["energy_share"].values()))}
    out = {"energy_share": energy, "energy_share_mean": {}, "reconstruction": {}, "gradient": {}}
    for b, vals in shares.items():
        mean, ci = mean_interval(vals)
        out["energy_share_mean"][b] = {"mean": mean, "ci95": ci, "per_batch": vals}
    for part, keys in (("reconstruction", ("mean_rel_error",)), ("gradient", ("mean_rel_error", "mean_cosine"))):
        for k, first_entry in first[part].items():
            entry = {key: v for key, v in first_entry.items() if key != "layers"}
            entry["bits_per_element"] = statistics.mean(r[part][k]["bits_per_element"] for r in per_batch)
            for key in keys:
                vals = [r[part][k][key] for r in per_batch]
                entry[key], entry[key + "_ci95"] = mean_interval(vals)
                entry[key + "_per_batch"] = vals
            out[part][k] = entry
    return out


def analyse_checkpoint(args, out: Path, tag: str):
    """The figures of one trained network over ``--batches`` class-balanced test batches, with intervals."""
    from division.analysis import balanced_batches, cifar10_data_config
    data_cfg = cifar10_data_config(args.data_root, 4 * args.batches * args.batch if args.synthetic else 0)
    batches = balanced_batches(data_cfg, args.batches, max(1, args.batch // int(data_cfg.num_classes)))
    model = create_model(args.model, num_classes=int(data_cfg.num_classes))
    ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
    model.load_state_dict(ckpt["model"])
    per_batch = []
    for i, (x, y) in enumerate(batches):
        per_batch.append(analyse(model, x, y, args.draws, i))
        print(f"batch {i + 1}/{len(batches)} done", flush=True)
    json_path = out / f"frequency_{tag}.json"
    stage = f"trained ({results.relative_to_root(args.checkpoint)}, epoch {ckpt.get('epoch')})"
    report = {"model": args.model, "data": "synthetic" if args.synthetic else "cifar10 (JPEG copy)",
              "batch": int(batches[0][1].numel()), "batches": len(batches), "draws": args.draws,
              "checkpoint": results.relative_to_root(args.checkpoint), "json": json_path.name,
              "command": results.command_line("scripts/analyze_frequency.py", sys.argv[1:]),
              **results.provenance(torch.device("cpu")), "stages": {stage: _aggregate(per_batch)}}
    results.write_json(json_path, report)
    print(write_outputs(out, tag, report))


def write_outputs(out: Path, tag: str, report: dict) -> str:
    """The plots and the Markdown summary of ``report``; returns the summary."""
    plots(out, tag, report)
    text = summary(report)
    results.write_text(out / f"frequency_{tag}.md", text + "\n")
    return text


if __name__ == "__main__":
    main()
