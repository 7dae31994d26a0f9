"""Regenerate results/tables/ (Markdown, LaTeX, CSV, PNG) from results/bench/ and results/runs/, with the
paper's published numbers (results/reference/division_paper_numbers.json) beside ours.

    python scripts/make_tables.py [--results results]
"""
import argparse
import csv
import io
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from division import CONFIG_DIR, results  # noqa: E402
from division.analysis import mean_interval, welch_interval  # noqa: E402
import results_pages  # noqa: E402  (scripts/ is on the path)
from results_pages import load as _load, load_runs  # noqa: E402
METHOD_ORDER = ["fp", "checkpoint", "sac", "compile_budget:budget=0.5", "compile_budget:budget=0.1", "swap", "blpa",
                "mesa", "actnn", "division", "division_nolfc", "division_keep_input", "division_plus", "wrpn"]
PAPER_NAMES = {"fp": "vanilla", "checkpoint": "checkpoint", "blpa": "blpa", "actnn": "actnn", "division": "division"}
GB = 1024 ** 3
MB = 1024 ** 2


def _write_table(stem: Path, header, rows, caption: str):
    table = io.StringIO()
    w = csv.writer(table)
    w.writerow(header)
    w.writerows(rows)
    results.write_text(stem.with_suffix(".csv"), table.getvalue())
    md = [f"{caption}\n", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    results.write_text(stem.with_suffix(".md"), "\n".join(md) + "\n")
    esc = lambda s: str(s).replace("_", r"\_").replace("%", r"\%").replace("±", r"$\pm$")
    tex = [r"\begin{table}[t]", r"\centering", rf"\caption{{{esc(caption)}}}",
           r"\begin{tabular}{" + "l" * len(header) + "}", r"\toprule", " & ".join(esc(h) for h in header) + r" \\",
           r"\midrule"] + [" & ".join(esc(c) for c in row) + r" \\" for row in rows] + [r"\bottomrule",
                                                                                          r"\end{tabular}", r"\end{table}"]
    results.write_text(stem.with_suffix(".tex"), "\n".join(tex) + "\n")
    return "\n".join(md)


def commits(records, per_row: bool = False):
    """(label, warning) for the commits a table's rows come from: one clean commit is the norm (``per_row``:
    each row names its own commit, so only uncommitted code is warned about)."""
    tags = sorted({(r.get("git_sha") or "unknown")[:8] + ("+dirty" if r.get("git_dirty") else "")
                   for r in records})
    warning = ""
    if len(tags) > 1 and not per_row:
        warning = f"WARNING: rows come from {len(tags)} commits"
    if any(r.get("git_dirty") for r in records) or any(not r.get("git_sha") for r in records):
        warning += ("; " if warning else "WARNING: ") + "some rows come from uncommitted code or record no commit"
    return ", ".join(tags), warning


def _caption(text, records, per_row: bool = False):
    label, warning = commits(records, per_row)
    if warning:
        print(f"{warning} ({label})", file=sys.stderr)
    return f"{text} Commit(s): {label}." + (f" {warning}." if warning else "")


def _methods(records):
    found = {r["method"] for r in records}
    return [m for m in METHOD_ORDER if m in found] + sorted(found - set(METHOD_ORDER))


def memory_table(bench, paper, out: Path):
    """(a) activation memory per method and batch, with the ratio to fp, beside the paper's GPU figures."""
    texts = []
    by_suite = defaultdict(list)
    for r in bench:
        by_suite[(r.get("suite", "?"), r.get("amp", "none"))].append(r)
    for (suite, amp), recs in sorted(by_suite.items()):
        if amp != "none":
            continue
        devices = sorted({r.get("device", "?") for r in recs if r.get("device")})
        header = ["model", "batch", "method", "activation MiB", "fp-equivalent MiB", "ratio", "ratio without input",
                  "step peak growth MiB", "process peak MiB", "paper act. GB (batch)", "paper ratio"]
        rows = []
        for model in sorted({r["model"] for r in recs}):
            paper_setting = _paper_setting(recs, model)
            for batch in sorted({r["batch_size"] for r in recs if r["model"] == model}):
                for method in _methods([r for r in recs if r["model"] == model]):
                    rec = next((r for r in recs if r["model"] == model and r["batch_size"] == batch
                                and r["method"] == method), None)
                    p_act, p_ratio = _paper_memory(paper, model, method) if paper_setting else ("", "")
                    if rec is None:
                        rows.append([model, batch, method, "missing", "", "", "", "", "", p_act, p_ratio])
                    elif rec["status"] != "ok":
                        rows.append([model, batch, method, rec["status"], "", "", "", "", "", p_act, p_ratio])
                    else:
                        without = rec.get("act_compression_without_input")
                        rows.append([model, batch, method, f"{rec['act_mem_bytes'] / MB:.1f}",
                                     f"{rec['act_mem_fp_bytes'] / MB:.1f}", f"{rec['act_compression']:.2f}x",
                                     "not recorded" if without is None else f"{without:.2f}x",
                                     f"{rec['peak_mem_growth_bytes'] / MB:.0f}", f"{rec['peak_mem_bytes'] / MB:.0f}",
                                     p_act, p_ratio])
        how = sorted({r.get("peak_mem_how", "not recorded") for r in recs if r["status"] == "ok"})
        caption = _caption(
            f"Activation memory held for backward, suite '{suite}' ({'; '.join(devices)}). Ratio = "
            f"full-precision-equivalent / held bytes (parameters and their views excluded); without input = the "
            f"same with the model's input left out of both (the paper's measure; recorded from bf383ac on). Step "
            f"peak growth = "
            f"peak memory of the training steps above what was in use just before them (weights, inputs); "
            f"process peak = that peak itself ({'; '.join(how)}). Paper: GPU, batch 64, activation GB and "
            f"vanilla/method.", recs)
        texts.append(_write_table(out / f"memory_{suite}", header, rows, caption))
        _plot_memory(recs, out / f"memory_{suite}.png", f"{suite}: {'; '.join(devices)}")
    return texts


ABLATION_LABELS = {
    "division": "DIVISION (the paper)",
    "division_plus": "division_plus (every contribution on)",
    "division_plus:fuse_bn_relu=false": "division_plus without the fused BN->ReLU saving",
    "division_plus:stat_dtype=fp32": "division_plus with fp32 map statistics",
    "division_plus:block_size=8": "division_plus with B=8 LFC blocks",
    "division_plus:small_map_elems=256": "division_plus plus groups for maps <= 256 elements",
    "division_plus:keep_input=true": "division_plus with the model's input held exactly (counted in full)",
    "division_plus:single_block_lfc=false": "division_plus without an LFC for maps one block covers",
    "division:fuse_bn_relu=true": "DIVISION plus the fused BN->ReLU saving only",
}


def ablation_table(bench, out: Path):
    """Each contribution of division_plus on and off: held bytes and ratio, change against division_plus."""
    texts = []
    for suite in sorted({r.get("suite") for r in bench if r.get("method") == "division_plus"}):
        recs = [r for r in bench if r.get("suite") == suite and r["status"] == "ok" and r["method"] in ABLATION_LABELS
                and r.get("amp", "none") == "none"]
        if not any(":" in r["method"] for r in recs):
            continue  # no variant measured: the memory table has these rows
        rows = []
        for model in sorted({r["model"] for r in recs}):
            paper_setting = _paper_setting(recs, model)
            for batch in sorted({r["batch_size"] for r in recs if r["model"] == model}):
                here = {r["method"]: r for r in recs if r["model"] == model and r["batch_size"] == batch}
                full = here.get("division_plus")
                for method, label in ABLATION_LABELS.items():
                    rec = here.get(method)
                    if rec is None:
                        continue
                    change = (f"{100 * (rec['act_mem_bytes'] / full['act_mem_bytes'] - 1):+.1f} %" if full else "")
                    rows.append([model, batch, label, f"{rec['act_mem_bytes'] / MB:.2f}",
                                 f"{rec['act_compression']:.2f}x", change])
        caption = _caption(f"division_plus ablation, suite '{suite}': activation memory held for backward with each "
                           "contribution switched off (or, for DIVISION, on alone); change = held bytes against "
                           "division_plus.", recs)
        texts.append(_write_table(out / f"division_plus_ablation_{suite}", ["model", "batch", "variant", "held MiB",
                                                                          "ratio", "held vs division_plus"],
                                  rows, caption))
    return texts


def gpu_table(bench, paper, out: Path):
    """The paper's setting on a GPU (suites measured under autocast): per batch and method, held bytes and ratio
    against fp's activations in the same dtype, peak memory, throughput and its ratio to fp at the same batch,
    beside the paper's figures (its activation memory was measured in fp32, its throughput under fp16)."""
    texts = []
    for suite in sorted({r.get("suite") for r in bench if r.get("amp", "none") != "none"}):
        recs = [r for r in bench if r.get("suite") == suite and r.get("amp", "none") != "none"]
        header = ["model", "batch", "method", "amp", "held MiB", "ratio", "ratio vs fp32", "peak MiB", "img/s",
                  "relative to fp", "paper act. GB (fp32)", "paper ratio (fp32)", "paper img/s",
                  "paper relative to vanilla"]
        rows = []
        for model in sorted({r["model"] for r in recs}):
            sizes = paper.get("activation_memory_gb", {}).get("batch_sizes", [])
            for batch in sorted({r["batch_size"] for r in recs if r["model"] == model}):
                here = {r["method"]: r for r in recs if r["model"] == model and r["batch_size"] == batch}
                fp = here.get("fp") if here.get("fp", {}).get("status") == "ok" else None
                for method in _methods(list(here.values())):
                    rec = here[method]
                    row = [model, batch, method, rec.get("amp")]
                    if rec["status"] != "ok":
                        row += [rec["status"]] + [""] * 7
                    else:
                        speed = rec["throughput_img_s"]
                        fp32 = rec.get("act_compression_fp32")
                        row += [f"{rec['act_mem_bytes'] / MB:.1f}", f"{rec['act_compression']:.2f}x",
                                f"{fp32:.2f}x" if fp32 else "", f"{rec['peak_mem_bytes'] / MB:.0f}", f"{speed:.1f}",
                                f"{speed / fp['throughput_img_s']:.2f}" if fp else ""]
                    row += _paper_at(paper, model, method, batch, sizes)
                    rows.append(row)
        caption = _caption(f"ResNet-50 at 224x224 on a GPU, suite '{suite}': activation memory held for backward "
                           "(ratio against fp's activations in the autocast dtype; ratio vs fp32: against what fp32 "
                           "training of the same step holds, measured, the paper's baseline), process peak, throughput "
                           "(median of the timed steps, one process per configuration; the paired table has "
                           "interleaved ratios) and the paper's figures at the same batch.", recs)
        texts.append(_write_table(out / f"gpu_{suite.removeprefix('gpu_')}", header, rows, caption))
    return texts


def _paper_at(paper, model, method, batch, sizes):
    """The paper's activation GB and ratio (fp32), images/s and ratio to vanilla at ``batch``, where given."""
    if batch not in sizes:
        return [""] * 4
    i, name = sizes.index(batch), PAPER_NAMES.get(method, "")
    mem = paper.get("activation_memory_gb", {}).get(model, {})
    speed = paper.get("throughput_images_per_s", {}).get(model, {})
    def at(table, key):
        return (table.get(key) or [None] * len(sizes))[i]
    act, vanilla, ips, ips_vanilla = at(mem, name), at(mem, "vanilla"), at(speed, name), at(speed, "vanilla")
    return ["" if act is None else f"{act:.2f}", f"{vanilla / act:.1f}x" if act and vanilla else "",
            "" if ips is None else f"{ips:.0f}", f"{ips / ips_vanilla:.2f}" if ips and ips_vanilla else ""]


PAPER_MEMORY_SIZE = 224  # the paper's activation-memory figures: ImageNet models at 224x224


def _paper_setting(recs, model) -> bool:
    """The paper's memory figures sit beside ours only for the input size they were measured at (a resnet50
    with the CIFAR stem at 32x32 is another network)."""
    return all(r.get("image_size", PAPER_MEMORY_SIZE) == PAPER_MEMORY_SIZE for r in recs if r["model"] == model)


def _paper_memory(paper, model, method):
    mem = paper.get("activation_memory_gb", {}).get(model, {})
    name = PAPER_NAMES.get(method)
    if not mem or name not in mem or mem[name][0] is None:
        return "", ""
    return f"{mem[name][0]:.2f} (64)", f"{mem['vanilla'][0] / mem[name][0]:.1f}x"


def throughput_table(bench, paper, out: Path):
    """(b) throughput against batch size per model and method. A suite measured in several rounds
    (results/bench/<suite>/<round>/...) gets the median over rounds, its range, and the median of each
    round's ratio to that round's fp, so that slow spells of a shared machine cancel."""
    ok = [r for r in bench if r["status"] == "ok" and r.get("round")]
    if not ok:
        return []
    cells = defaultdict(list)
    for r in ok:
        cells[(r.get("suite", ""), r["model"], r["batch_size"], r["method"], r.get("amp", "none"))].append(r)
    header = ["suite", "model", "batch", "method", "amp", "img/s", "range (rounds)", "relative to fp",
              "paper img/s (batch 64)"]
    rows, merged = [], []
    for key in sorted(cells, key=lambda k: (k[0], k[1], k[2], _rank(k[3]))):
        suite, model, batch, method, amp = key
        recs = cells[key]
        speeds = [r["throughput_img_s"] for r in recs]
        fp_by_round = {r.get("round"): r["throughput_img_s"] for r in cells.get((suite, model, batch, "fp", amp), [])}
        ratios = [r["throughput_img_s"] / fp_by_round[r.get("round")] for r in recs if r.get("round") in fp_by_round]
        pth = paper.get("throughput_images_per_s", {}).get(model, {}).get(PAPER_NAMES.get(method, ""), [None])
        spread = f"{min(speeds):.2f}-{max(speeds):.2f} ({len(speeds)})" if len(speeds) > 1 else ""
        rows.append([suite, model, batch, method, amp, f"{statistics.median(speeds):.2f}", spread,
                     f"{statistics.median(ratios):.2f}" if ratios else "", "" if pth[0] is None else f"{pth[0]:.0f}"])
        merged.append(dict(recs[0], throughput_img_s=statistics.median(speeds)))
    text = _write_table(out / "throughput", header, rows, _caption(
        "Training throughput (median over timed steps, synthetic data on the device) from suites measured in "
        "interleaved rounds; relative to fp = median over rounds of each round's ratio to that round's fp.", ok))
    _plot_throughput(merged, out / "throughput.png")
    return [text]


def paired_throughput_table(paired, out: Path):
    """Throughput ratios taken in one process, step by step (``scripts/bench.py --paired``): the median of
    the per-round ratios to the first method and their quartiles."""
    ok = [r for r in paired if r["status"] == "ok"]
    if not ok:
        return []
    header = ["suite", "model", "batch", "method", "img/s", "relative to baseline", "quartiles", "paired steps",
              "commit", "device"]
    rows = []
    for r in sorted(ok, key=lambda r: (r.get("suite", ""), r["model"], r["batch_size"])):
        for m in r["methods"]:
            rows.append([r.get("suite", ""), r["model"], r["batch_size"], m["method"], f"{m['throughput_img_s']:.2f}",
                         f"{m['relative_to_first']:.3f} of {r['baseline']}",
                         f"{m['relative_q1']:.3f}-{m['relative_q3']:.3f}", len(m["step_times_s"]),
                         commits([r])[0], r.get("device", "")])
    return [_write_table(out / "throughput_paired", header, rows, _caption(
        "Training throughput relative to a baseline, paired: every method's model in one process, one timed step "
        "each per round in alternating order, the ratio taken per round (median and quartiles over rounds); each "
        "file is one process at one commit (column commit).", ok, per_row=True))]


def _rank(method):
    return METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)


def experiments_of(runs):
    """Experiments with a config in src/division/configs/experiment/: ad-hoc and smoke runs never enter a table."""
    known = {p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml")}
    return sorted({Path(r["_path"]).parts[0] for r in runs} & known)


def _mean_std_cell(values):
    """"mean ± sample std" of a list; the mean alone for one value (its spread is unknown, not 0); "" when empty."""
    if not values:
        return ""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def _mean_of(records, key):
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.mean(values) if values else None


def _run_speed(run):
    """A run's training throughput: the median over its epochs (the last epoch alone swings with whatever else
    shared the machine at that moment), or the result's figure when it has no per-epoch record."""
    speeds = [e["throughput_img_s"] for e in run.get("epochs") or [] if e.get("throughput_img_s")]
    return statistics.median(speeds) if speeds else run.get("throughput_img_s")


def _threads(run):
    return ((run.get("config") or {}).get("trainer") or {}).get("threads")


def _processor(run):
    """A run's processor or GPU, shortly ("Xeon", "AMD EPYC", "NVIDIA H200 fp32": a GPU with the precision of
    its fp32 convolutions), from its recorded device."""
    gpu = re.fullmatch(r"cuda: (.*?)(?: \(convolutions (\w+), matmuls \w+\))?", str(run.get("device") or ""))
    if gpu:
        return " ".join(part for part in gpu.groups() if part)
    device = re.sub(r"\((R|TM)\)|Processor|CPU|@.*?GHz", "", str(run.get("device") or ""))
    device = re.sub(r"^cpu: (Intel )?|, \d+ logical cores.*$", "", device)
    return " ".join(device.split()) or "?"


def _where(run):
    """Where a run's speed was measured: the processor and the thread count (e.g. "Xeon 1 thr"), or the GPU."""
    if str(run.get("device") or "").startswith("cuda"):
        return _processor(run)
    return f"{_processor(run)} {_threads(run)} thr"


def _speed_cell(records, fp_records):
    """Speed of a method's runs: the mean img/s per processor and thread count, and the mean ratio to fp over
    the seeds whose fp run ran on the same processor with the same thread count (runs on other machines, or
    a 1-thread run beside another run against a 2-thread run alone, are not comparable)."""
    timed = [((r.get("seed"), _where(r)), s) for r in records for s in [_run_speed(r)] if s is not None]
    if not timed:
        return ""
    by_where = defaultdict(list)
    for (_, where), speed in timed:
        by_where[where].append(speed)
    fp_of = {(r.get("seed"), _where(r)): s for r in fp_records for s in [_run_speed(r)] if s}
    ratios = [speed / fp_of[key] for key, speed in timed if key in fp_of]
    speeds = "; ".join(f"{statistics.mean(v):.1f}" + (f" @{w}" if len(by_where) > 1 else "")
                       for w, v in sorted(by_where.items()))
    if not ratios:
        return speeds
    paired = "" if len(ratios) == len(records) else f" [{len(ratios)} of {len(records)} runs]"
    return f"{speeds} ({statistics.mean(ratios):.2f}){paired}"


def _method_label(run):
    """A run's method, with the model's widening where it has one (WRPN's 2x-wide network is another network,
    compared with fp at the published width, as the WRPN paper does)."""
    width = run.get("config", {}).get("model", {}).get("width_mult", 1)
    return run["method"] if width == 1 else f"{run['method']} ({width:g}x wide)"


def accuracy_tables(runs, paper, out: Path, only=None):
    texts = []
    for exp in experiments_of(runs):
        if only and exp not in only:
            continue
        texts += accuracy_table([r for r in runs if Path(r["_path"]).parts[0] == exp], paper, out, exp)
    return texts


def accuracy_table(runs, paper, out: Path, experiment: str):
    """(c) accuracy per method of one experiment: final and best top-1 (mean ± std over seeds), n, gap to fp,
    activation compression and throughput of the same runs, the commits of each row."""
    ok = [dict(r, method=_method_label(r)) for r in runs if r.get("status") == "ok" and r.get("top1") is not None]
    if not ok:
        return []
    groups = defaultdict(list)
    for r in ok:
        experiment = Path(r["_path"]).parts[0] if len(Path(r["_path"]).parts) > 2 else r.get("experiment", "default")
        groups[(experiment, r["data"], r["model"], r["method"])].append(r)
    tta = any(r.get("top1_tta") is not None for r in ok)
    header = ["experiment", "data", "model", "method", "top-1 % (mean ± std)", "best top-1 %", "n", "gap to fp",
              "activation compression", "img/s (rel. to fp)", "commit(s)", "paper top-1 %"]
    if tta:
        header[5:5] = [f"top-1 % with TTA (mean ± std)"]
    header[header.index("gap to fp") + 1:header.index("gap to fp") + 1] = ["vs fp, Welch 95 % (unpaired)"]
    rows = []
    fp = {key[:3]: recs for key, recs in groups.items() if key[3] == "fp"}
    mixed = []
    for (exp, data, model, method), recs in sorted(groups.items(), key=lambda kv: (kv[0][:3], _rank(kv[0][3]))):
        top1 = [r["top1"] for r in recs]
        mean = statistics.mean(top1)
        fp_recs = fp.get((exp, data, model), [])
        seeds = {r.get("seed") for r in recs}
        fp_same_seeds = [r for r in fp_recs if r.get("seed") in seeds] or fp_recs
        gap = "" if not fp_recs else f"{mean - statistics.mean(r['top1'] for r in fp_same_seeds):+.2f}"
        compression = _mean_of(recs, "act_compression")
        without_input = _mean_of(recs, "act_compression_without_input")
        held, reference, fp_held = (_mean_of(recs, "act_mem_bytes"), _mean_of(recs, "act_mem_fp_bytes"),
                                    _mean_of(fp_recs, "act_mem_bytes"))
        against_fp = (held and reference and fp_held and abs(reference - fp_held) > 0.01 * fp_held)
        label, warning = commits(recs)
        if warning:
            mixed.append(method)
        prow = paper.get("accuracy_top1_percent", {})
        cols, prows = prow.get("columns", []), prow.get("rows", {})
        pname = {"fp": "normal"}.get(method, method)
        pval = ""
        if exp.startswith("paper_") and f"{data}/{model}" in prows and pname in cols:
            v = prows[f"{data}/{model}"][cols.index(pname)]
            pval = "" if v is None else f"{v:.2f}"
        key = "top1_tta" if tta else "top1"
        mine, theirs = [r[key] for r in recs if r.get(key) is not None], [r[key] for r in fp_recs if r.get(key) is not None]
        welch = welch_interval(mine, theirs)[1] if method != "fp" and mine and theirs else None
        welch_cell = "" if welch is None else f"[{welch[0]:+.2f}, {welch[1]:+.2f}]"
        tta_cell = [_mean_std_cell([r["top1_tta"] for r in recs if r.get("top1_tta") is not None])] if tta else []
        rows.append([exp, data, model, method, _mean_std_cell(top1), *tta_cell,
                     _mean_std_cell([r["best_top1"] for r in recs if r.get("best_top1") is not None]), len(recs), gap,
                     welch_cell,
                     ("" if compression is None else f"{compression:.2f}x")
                     + ("" if without_input is None else f" ({without_input:.2f}x without input)")
                     + (f"; {fp_held / held:.2f}x against fp" if against_fp else ""),
                     _speed_cell(recs, fp_recs),
                     label, pval])
    warning = f" WARNING: rows mixing commits or uncommitted code: {', '.join(mixed)}." if mixed else ""
    text = _write_table(out / f"accuracy_{experiment}", header, rows,
                        f"Experiment {experiment}: test top-1 accuracy at the last epoch and the best epoch, mean ± "
                        "std over seeds (n runs; one run: no std)" + (", and with test-time augmentation" if tta else "")
                        + "; gap = method mean - fp mean over the same "
                        "seeds (over all of fp's where it shares none); Welch 95 % interval of the unpaired "
                        "difference to fp over all runs" + (" (top-1 with TTA)" if tta else "") + "; activation compression of the "
                        "last epoch's first step (and without the model's input, where recorded), mean over the "
                        "same runs, against the method's own network under plain autograd, and also "
                        "against fp's held bytes where that network is another (a widened model); training throughput per run is the median over its epochs, shown as the mean "
                        "per processor and thread count and, in brackets, the mean ratio to fp's run of the same "
                        "seed, processor and thread count ([k of n runs] where only k have such a pair); runs that "
                        "shared the CPU with other work are slowed by it, so these speeds are indicative only: the "
                        "paired benchmarks (throughput_paired) measure speed. "
                        "Each row should come from one clean commit (listed per row). Paper figures appear beside "
                        f"runs of the paper's own recipes (experiments paper_*).{warning}")
    acc = paper.get("accuracy_top1_percent", {})
    if acc:
        cols = acc["columns"]
        prow = [[k] + ["" if v is None else f"{v:.2f}" for v in vals] for k, vals in acc["rows"].items()]
        text += "\n\n" + _write_table(out / "accuracy_paper", ["data/model"] + cols, prow,
                                       "The paper's published top-1 accuracy (GPU, full recipes): "
                                       + paper.get("source", ""))
    _plot_accuracy_curves(ok, out / f"accuracy_curves_{experiment}.png", experiment)
    paired = paired_table(ok, out, experiment)
    return [text] + paired


def compile_table(records, out: Path):
    """trainer.compile=true: per model and batch, eager and compiled side by side (scripts/compile_check.py)."""
    rows = []
    for rec in sorted(records, key=lambda r: (r["model"], r["batch_size"], r.get("amp", "none"))):
        for m in rec["memory"]:
            speed = rec["speed"].get(m["method"] + (" compiled" if m["compiled"] else ""), {})
            q = speed.get("quartiles") or ["", ""]
            rows.append([rec["model"], rec["batch_size"], rec.get("amp", "none"), m["method"],
                         "compiled" if m["compiled"] else "eager", m["graph_breaks"],
                         f"{m['held_bytes'] / MB:.2f}", f"{m['ratio']:.2f}x", speed.get("img_s", ""),
                         f"{speed['relative_to_fp_same_mode']:.3f} [{q[0]}, {q[1]}]" if speed else "",
                         results_pages._device(rec), (rec.get("git_sha") or "unknown")[:8]])
    if not rows:
        return []
    return [_write_table(out / "compile", ["model", "batch", "amp", "method", "mode", "graph breaks", "held MiB",
                                           "compression", "img/s", "of fp in the same mode (median [quartiles])",
                                           "device", "commit"], rows, _caption(
        "torch.compile (trainer.compile=true) against eager: graph breaks Dynamo counted, bytes the step holds for "
        "backward (a compiled step: the compiled functions' saved tensors, de-duplicated by storage) and its "
        "compression against plain autograd in the same mode, and speed from interleaved steps in one process "
        "(eager fp, eager method, compiled fp, compiled method each round; ratio per round, median and quartiles "
        "over rounds).", records, per_row=True))]


def budget_table(records, out: Path):
    """method.budget: per model, batch and budget, the bytes planned and held against the budget."""
    rows = []
    for rec in sorted(records, key=lambda r: (r["model"], r["batch_size"], r["method"])):
        for row in rec["rows"]:
            rows.append([rec["model"], rec["batch_size"], rec["method"], row["budget"],
                         f"{row['budget_bytes'] / MB:.2f}", f"{row['held_bytes'] / MB:.2f}",
                         f"{100 * row['held_of_budget']:.2f} %", f"{row['act_compression']:.2f}x",
                         f"{row['calibrate_seconds']:.1f}", ", ".join(f"{k} x{v}" for k, v in sorted(row["choices"].items())),
                         (rec.get("git_sha") or "unknown")[:8]])
    if not rows:
        return []
    return [_write_table(out / "budget", ["model", "batch", "method", "budget", "budget MiB", "held MiB",
                                          "held / budget", "compression", "calibration s", "choices (layers)",
                                          "commit"], rows, _caption(
        "method.budget: one training step's held activation bytes after the method planned each layer's precision "
        "from one observed step on another batch (python scripts/budget_fit.py); compression against plain "
        "autograd on the same batch; calibration time includes that observed step.", records, per_row=True))]


def max_batch_table(records, out: Path):
    """(d) the largest batch per method under a memory budget."""
    if not records:
        return []
    header = ["model", "method", "budget", "CPU allocator", "max batch", "ratio to fp", "device"]
    rows = []
    alloc = lambda r: f"mmap >= {r['malloc_mmap_threshold']} B" if r.get("malloc_mmap_threshold") else "glibc default"
    for r in sorted(records, key=lambda r: (r["model"], r.get("budget", ""), alloc(r), _rank(r["method"]))):
        fp = next((q for q in records if q["model"] == r["model"] and q.get("budget") == r.get("budget")
                   and q["method"] == "fp" and alloc(q) == alloc(r)), None)
        ratio = f"{r['max_batch'] / fp['max_batch']:.2f}" if fp and fp.get("max_batch") else ""
        rows.append([r["model"], r["method"], r.get("budget", ""), alloc(r), r.get("max_batch", r["status"]), ratio,
                     r.get("device", "")])
    return [_write_table(out / "max_batch", header, rows, _caption("Largest trainable batch under a memory budget.",
                                                                   records))]


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_memory(recs, path, title):
    plt = _plt()
    ok = [r for r in recs if r["status"] == "ok"]
    models = sorted({r["model"] for r in ok})
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for method in _methods([r for r in ok if r["model"] == model]):
            pts = sorted((r["batch_size"], r["act_mem_bytes"] / MB) for r in ok if r["model"] == model and r["method"] == method)
            ax.plot(*zip(*pts), marker="o", label=method)
        ax.set_xlabel("batch size")
        ax.set_ylabel("activation memory (MiB)")
        ax.set_yscale("log")
        ax.set_title(model)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    _save(plt, fig, path)


def _plot_throughput(ok, path):
    plt = _plt()
    models = sorted({(r.get("suite", ""), r["model"]) for r in ok})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, (suite, model) in zip(axes[0], models):
        sel = [r for r in ok if r["model"] == model and r.get("suite", "") == suite]
        for method in _methods(sel):
            pts = sorted((r["batch_size"], r["throughput_img_s"]) for r in sel if r["method"] == method)
            ax.plot(*zip(*pts), marker="o", label=method)
        devices = sorted({r.get("device", "?") for r in sel})
        ax.set_title(f"{model} ({suite})\n{'; '.join(devices)}", fontsize=7)
        ax.set_xlabel("batch size")
        ax.set_ylabel("images / s")
        ax.legend(fontsize=7)
    _save(plt, fig, path)


def paired_differences(ok, method: str, baseline: str, key: str = "top1"):
    """Per-seed differences of ``key`` (top-1, or top-1 with TTA) method - baseline over the seeds both have
    (paired by seed), their mean and 95 % t interval (n-1 degrees of freedom); None where fewer than two
    pairs exist."""
    a = {r["seed"]: r[key] for r in ok if r["method"] == method and r.get(key) is not None}
    b = {r["seed"]: r[key] for r in ok if r["method"] == baseline and r.get(key) is not None}
    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds]
    if len(diffs) < 2:
        return seeds, diffs, None, None
    mean, interval = mean_interval(diffs)
    return seeds, diffs, mean, interval


# The comparisons beyond "each method against fp" that the paired table answers: (method, baseline).
QUESTION_PAIRS = (
    ("division", "division_nolfc"),  # what the LFC buys
    ("division", "actnn"),  # the paper's 2-bit rival
    ("division_plus", "division"),  # what division_plus's savings cost
    ("division_keep_input", "division"),  # what holding the model's input exactly buys
)


def paired_table(ok, out: Path, experiment: str):
    """Each method against fp, then the QUESTION_PAIRS whose both methods have runs and each byte budget's runs
    against DIVISION, paired by seed."""
    methods = _methods(ok)
    pairs = [(m, "fp") for m in methods if m != "fp"]
    pairs += [(a, b) for a, b in QUESTION_PAIRS if a in methods and b in methods]
    # a byte budget's question: at its compression, does training keep DIVISION's accuracy?
    pairs += [(m, "division") for m in methods if ":budget=" in m and "division" in methods]
    header = ["comparison", "seeds", "per-seed difference (points)", "mean", "95 % CI (t)", "reading"]
    keys = ["top1"] + (["top1_tta"] if any(r.get("top1_tta") is not None for r in ok) else [])
    rows = []
    for (method, base), key in ((pair, key) for pair in pairs for key in keys):
        seeds, diffs, mean, ci = paired_differences(ok, method, base, key)
        if not diffs:
            continue
        if ci is None:
            reading = "fewer than two paired seeds: no interval"
        elif ci[0] > 0 or ci[1] < 0:
            reading = f"{method} {'above' if ci[0] > 0 else 'below'} {base} (interval excludes 0)"
        else:
            reading = f"no difference shown; the interval allows {ci[0]:+.2f} to {ci[1]:+.2f} points"
        rows.append([f"{method} - {base}" + (" (with TTA)" if key == "top1_tta" else ""), ",".join(map(str, seeds)), ", ".join(f"{d:+.2f}" for d in diffs),
                     "" if mean is None else f"{mean:+.2f}", "" if ci is None else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]",
                     reading])
    if not rows:
        return []
    return [_write_table(out / f"accuracy_{experiment}_paired", header, rows, _caption(
        f"Experiment {experiment}: top-1 differences paired by seed (a seed fixes initial weights and data order "
        "for every method), mean and 95 % confidence interval (Student's t, n-1 degrees of freedom).", ok))]


def _plot_accuracy_curves(ok, path, experiment):
    """One colour per method: the mean over seeds, with a band from the lowest to the highest seed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, method in enumerate(_methods(ok)):
        curves = defaultdict(list)
        runs = [r for r in ok if r["method"] == method]
        for r in runs:
            for e in r["epochs"]:
                if e.get("top1") is not None:
                    curves[e["epoch"]].append(e["top1"])
        epochs = sorted(curves)
        if not epochs:
            continue
        colour = colours[i % len(colours)]
        ax.plot(epochs, [statistics.mean(curves[e]) for e in epochs], color=colour,
                label=f"{method} (n={len(runs)})")
        if len(runs) > 1:
            ax.fill_between(epochs, [min(curves[e]) for e in epochs], [max(curves[e]) for e in epochs],
                            color=colour, alpha=0.2, linewidth=0)
    devices = sorted({_processor(r) for r in ok})
    ax.set_title(f"{experiment}: test top-1 vs epoch (mean over seeds, band = min-max)\n" + "; ".join(devices),
                 fontsize=7)
    ax.set_xlabel("epoch")
    ax.set_ylabel("top-1 %")
    ax.legend(fontsize=7)
    _save(plt, fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--results", default=str(ROOT / "results"))
    p.add_argument("--experiment", action="append", default=None,
                   help="accuracy table of this experiment only (repeatable; default: every experiment with "
                        "committed runs and a config in src/division/configs/experiment/)")
    args = p.parse_args(argv)
    res = Path(args.results)
    out = res / "tables"
    paper = json.loads((res / "reference" / "division_paper_numbers.json").read_text())
    bench = [r for r in _load(res / "bench") if "batch_size" in r]
    paired = [r for r in bench if r.get("paired")]
    bench = [r for r in bench if not r.get("paired")]
    for r in bench:  # the folder names the suite, a subfolder (if any) the round of a repeated suite
        parts = Path(r["_path"]).parts
        if len(parts) > 1:
            r["suite"] = parts[0]
        if len(parts) > 2:
            r["round"] = parts[1]
    runs = load_runs(res / "runs")
    maxb = [r for r in _load(res / "max_batch") if "max_batch" in r and ".probe" not in r["_path"]]
    texts = memory_table(bench, paper, out) + ablation_table(bench, out) + gpu_table(bench, paper, out) + \
        throughput_table(bench, paper, out) + \
        paired_throughput_table(paired, out) + \
        accuracy_tables(runs, paper, out, args.experiment) + max_batch_table(maxb, out) + \
        budget_table([r for r in _load(res / "budget") if "rows" in r], out) + \
        compile_table([r for r in _load(res / "compile") if "memory" in r], out)
    print("\n\n".join(texts) if texts else "no results found")
    print(f"\nwrote {out}")
    if res.resolve() == (ROOT / "results").resolve():
        from results_pages import write_pages
        pages = write_pages(res, ROOT)
        print("wrote " + ", ".join(results.relative_to_root(p) for p in pages))


if __name__ == "__main__":
    main()
