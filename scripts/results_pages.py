"""The results pages, written by ``make tables`` from the committed result files and never by hand:
``docs/results.md`` (every table with where its figures come from: command, commits with their dates,
devices) and the README's at-a-glance table, between its markers. ``tests/test_docs.py`` fails when a
committed page differs from what this module renders now."""
import json
import re
import statistics
import subprocess
from collections import defaultdict
from pathlib import Path

GLANCE_START, GLANCE_END = "<!-- at-a-glance:start -->", "<!-- at-a-glance:end -->"
GLANCE_METHODS = ["fp", "actnn", "division", "division_plus"]
NAMES = {"fp": "fp", "actnn": "ActNN 2-bit", "division": "DIVISION", "division_plus": "`division_plus`"}
# (heading, table-name pattern, what kind of records back it)
SECTIONS = [
    ("Accuracy", r"accuracy_(?!paper)(?!curves).*", "runs"),
    ("The paper's published accuracy", r"accuracy_paper", None),
    ("Activation memory", r"memory_.*", "bench"),
    ("On a GPU: the paper's setting", r"gpu_.*", "bench"),
    ("division_plus ablations", r"division_plus_ablation_.*", "bench"),
    ("Throughput", r"throughput.*", "bench"),
    ("Largest batch under a memory cap", r"max_batch", "max_batch"),
    ("A byte budget (method.budget)", r"budget", "budget"),
    ("torch.compile", r"compile", "compile"),
]


def load(folder: Path):
    out = []
    for path in sorted(folder.rglob("*.json")) if folder.exists() else []:
        try:
            rec = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "status" in rec and ".probe" not in path.parts:
            rec["_path"] = path.relative_to(folder).as_posix()
            out.append(rec)
    return out


def load_runs(folder: Path):
    """Training runs (result files with epochs); a run with ``method.budget`` is its own method in every table,
    ``<method>:budget=<budget>`` as the analyses name it, not one more seed of the method without it."""
    runs = [r for r in load(folder) if "epochs" in r]
    for r in runs:
        budget = (r.get("config", {}).get("method") or {}).get("budget")
        if budget not in (None, "", "null"):
            r["method"] = f"{r['method']}:budget={budget}"
    return runs


def commit_dates(root: Path, shas) -> dict:
    """{sha: commit date (YYYY-MM-DD)} from git, for the commits results record; absent when unknown."""
    shas = sorted({s for s in shas if s})
    if not shas:
        return {}
    proc = subprocess.run(["git", "show", "-s", "--format=%H %cs", *shas], cwd=root, capture_output=True, text=True)
    return dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)


def _device(rec) -> str:
    return re.sub(r", \d+ torch threads?$", "", rec.get("device") or "unknown")


def sources(records, command: str, dates: dict) -> str:
    """One line: command, commits (with dates), devices of the records behind a table."""
    commits = sorted({(r.get("git_sha") or "unknown")[:8] + ("+dirty" if r.get("git_dirty") else "") +
                      (f" ({dates[r['git_sha']]})" if r.get("git_sha") in dates else "") for r in records})
    devices = sorted({_device(r) for r in records})
    return (f"*Sources:* {len(records)} result files; command `{command}`; commits {', '.join(commits)}; "
            f"devices: {'; '.join(devices)}.")


def _bench_command(suite: str) -> str:
    config = f"src/division/configs/bench/{suite}.yaml"
    return f"python scripts/bench.py --config {config}" if suite.startswith("cpu") else \
        f"bash scripts/device/run.sh (suite {suite})"


def _records_for(kind, name, runs, bench, maxb, budgets=(), compiles=()):
    """(records, command) behind table ``name`` of a section of ``kind``."""
    if kind == "runs":
        exp = re.sub(r"^accuracy_|_paired$", "", name)
        recs = [r for r in runs if r.get("experiment") == exp and r.get("status") == "ok"]
        return recs, f"python train.py experiment={exp} method=<method> seed=<seed>"
    if kind == "max_batch":
        return maxb, "python scripts/max_batch.py --model <model> --methods <methods> --budget <bytes>"
    if kind == "budget":
        return budgets, "; ".join(sorted({r["command"] for r in budgets}))
    if kind == "compile":
        return compiles, "; ".join(sorted({r["command"] for r in compiles}))
    suite = re.sub(r"^(memory|division_plus_ablation)_", "", name)
    recs = [r for r in bench if r["_path"].split("/")[0] == suite]
    if name.startswith("throughput"):
        recs = [r for r in bench if r.get("paired")] if name == "throughput_paired" else \
            [r for r in bench if not r.get("paired") and r.get("throughput_img_s")]
        return recs, "python scripts/bench.py --config src/division/configs/bench/<suite>.yaml"
    return recs, _bench_command(suite)


# (experiment, accuracy key, row label): the accuracy sweeps the README shows, the fast recipe first.
ACCURACY_ROWS = (("cifar10_fast94", "top1_tta", "CIFAR-10 top-1 with TTA, fast94, 10 epochs"),
                 ("cifar10_resnet20_e50", "top1", "CIFAR-10 top-1, ResNet-20, 50 epochs"))
PAPER_MARGIN = 0.2  # points: the paper's "within about 0.2 points of full precision"


def _cell_accuracy(runs, method, key="top1"):
    recs = [r for r in runs if r["method"] == method]
    if not recs:
        return "", None
    top = [r[key] for r in recs]
    std = f" ± {statistics.stdev(top):.2f}" if len(top) > 1 else ""
    return f"{statistics.mean(top):.2f} %{std} (n={len(top)})", {r["seed"]: r[key] for r in recs}


def _accuracy_cells(recs, key):
    """Cells per method (mean ± std, n; the paired difference to fp with its 95 % t interval) and a reading of
    DIVISION's interval: what it excludes and what it cannot."""
    from division.analysis import mean_interval
    fp_cell, fp_seeds = _cell_accuracy(recs, "fp", key)
    cells, reading = [fp_cell], ""
    for m in GLANCE_METHODS[1:]:
        cell, seeds = _cell_accuracy(recs, m, key)
        common = sorted(set(seeds or ()) & set(fp_seeds or ()))
        if len(common) > 1:
            mean, (lo, hi) = mean_interval([seeds[s] - fp_seeds[s] for s in common])
            cell += f"; vs fp {mean:+.2f} [{lo:+.2f}, {hi:+.2f}]"
            if m == "division":
                reading = _reading(mean, lo, hi, len(common))
        cells.append(cell)
    return cells, reading


def _reading(mean, lo, hi, n) -> str:
    """What a paired 95 % interval of DIVISION - fp (points) allows, against the paper's claim."""
    span = f"DIVISION - fp = {mean:+.2f} points, 95 % interval [{lo:+.2f}, {hi:+.2f}] over {n} paired seeds"
    if hi < 0:
        verdict = "DIVISION is below fp here (the interval excludes 0)"
        if hi < -PAPER_MARGIN:
            verdict += f", by more than the paper's {PAPER_MARGIN} points"
    elif lo > 0:
        verdict = "DIVISION is above fp here (the interval excludes 0)"
    elif lo >= -PAPER_MARGIN:
        verdict = f"no difference shown, and a loss of more than the paper's {PAPER_MARGIN} points is ruled out"
    else:
        verdict = (f"no difference shown; a loss of up to {-lo:.2f} points is not ruled out, so the paper's "
                   f"'within {PAPER_MARGIN} points' is neither confirmed nor refuted")
    return f"{span}: {verdict}."


def glance(runs, bench) -> str:
    """The README's table: memory and paired speed on ResNet-50 (CPU, and GPU where measured), speed on the
    CIFAR ResNet-20, accuracy of the 50-epoch ResNet-20 sweep; each row names its source."""
    rows = []
    mem = {r["method"]: r for r in bench if r["_path"].startswith("cpu_compact/resnet50_b8_")}
    if mem:
        fp = mem.get("fp")
        cells = [f"{fp['act_mem_bytes'] / 2**20:.1f} MiB" if fp else ""] + \
            [f"{mem[m]['act_compression']:.2f}x less" if m in mem else "" for m in GLANCE_METHODS[1:]]
        rows.append(("activation memory, ResNet-50, 224x224, batch 8, CPU (memory_cpu_compact)", cells))
    for suite, label in (("cpu_throughput_paired", "ResNet-50, batch 8"),
                         ("cpu_throughput_paired_cifar", "CIFAR ResNet-20, batch 128")):
        paired = [r for r in bench if r.get("paired") and r["_path"].startswith(suite + "/")]
        for r in paired:
            by = {m["method"]: m for m in r["methods"]}
            cells = [f"{by['fp']['throughput_img_s']:.1f} img/s" if "fp" in by else ""] + \
                [f"{by[m]['relative_to_first']:.2f} of fp" if m in by else "" for m in GLANCE_METHODS[1:]]
            rows.append((f"training speed, {label}, CPU, paired steps (throughput_paired, {suite})", cells))
    for r_suite in sorted({r["_path"].split("/")[0] for r in bench if r["_path"].startswith("gpu_")}):
        gpu = {r["method"]: r for r in bench if r["_path"].startswith(r_suite + "/") and r.get("batch_size") == 256
               and r.get("status") == "ok" and not r.get("paired")}
        if gpu:
            cells = [f"{gpu['fp']['act_mem_bytes'] / 2**30:.2f} GiB" if "fp" in gpu else ""] + \
                [f"{gpu[m]['act_compression']:.2f}x less" if m in gpu else "" for m in GLANCE_METHODS[1:]]
            rows.append((f"activation memory, ResNet-50, 224x224, batch 256, fp16, "
                         f"{_device(next(iter(gpu.values()))).removeprefix('cuda: ')} ({r_suite})", cells))
            if gpu.get("fp", {}).get("act_mem_fp32_bytes"):  # the paper's baseline: fp32 training's activations
                cells = [f"{gpu['fp']['act_mem_fp32_bytes'] / 2**30:.2f} GiB"] + \
                    [f"{gpu[m]['act_compression_fp32']:.2f}x less" if gpu.get(m, {}).get("act_compression_fp32")
                     else "" for m in GLANCE_METHODS[1:]]
                rows.append((f"the same against fp32 training's activations (the paper's baseline) ({r_suite})",
                             cells))
        for r in (r for r in bench if r.get("paired") and r["_path"].startswith(r_suite + "/")):
            by = {m["method"]: m for m in r["methods"]}
            cells = [f"{by['fp']['throughput_img_s']:.0f} img/s" if "fp" in by else ""] + \
                [f"{by[m]['relative_to_first']:.2f} of fp" if m in by else "" for m in GLANCE_METHODS[1:]]
            rows.append((f"training speed, ResNet-50, batch {r.get('batch_size')}, fp16, "
                         f"{_device(r).removeprefix('cuda: ')}, paired steps (throughput_paired, {r_suite})", cells))
    readings = []
    for experiment, key, label in ACCURACY_ROWS:
        recs = [r for r in runs if r.get("experiment") == experiment and r.get("status") == "ok"
                and r.get(key) is not None]
        if recs:
            cells, reading = _accuracy_cells(recs, key)
            rows.append((f"{label}, paired by seed, 95 % interval (accuracy_{experiment})", cells))
            if reading:
                readings.append(f"{label}: {reading}")
    head = "| | " + " | ".join(NAMES[m] for m in GLANCE_METHODS) + " |\n|---|" + "---|" * len(GLANCE_METHODS)
    body = "\n".join(f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows)
    verdict = "".join(f"\n\n{r}" for r in readings)
    return f"{head}\n{body}{verdict}\n\nEvery figure's command, commit, date and device: [docs/results.md](docs/results.md)."


def results_page(res: Path, root: Path) -> str:
    runs = load_runs(res / "runs")
    bench = [r for r in load(res / "bench") if "batch_size" in r]
    maxb = [r for r in load(res / "max_batch") if "max_batch" in r]
    budgets = [r for r in load(res / "budget") if "rows" in r]
    compiles = [r for r in load(res / "compile") if "memory" in r]
    dates = commit_dates(root, [r.get("git_sha") for r in runs + bench + maxb + budgets])
    out = ["# Results", "",
           "Generated by `make tables` from the result files under `results/` (each records its commit, dirty flag, "
           "device and library versions); do not edit by hand. The tables themselves, also as CSV and LaTeX, are "
           "in `results/tables/`; the analysis reports in `results/analysis/` (see [analysis.md](analysis.md)).",
           "", "## At a glance", "", glance(runs, bench).replace("(docs/results.md)", "(results.md)"), ""]
    tables = sorted((res / "tables").glob("*.md"))
    for heading, pattern, kind in SECTIONS:
        chosen = [t for t in tables if re.fullmatch(pattern, t.stem)]
        if not chosen:
            continue
        out += [f"## {heading}", ""]
        for t in chosen:
            out += [f"### {t.stem}", "", t.read_text().strip(), ""]
            if kind:
                recs, command = _records_for(kind, t.stem, runs, bench, maxb, budgets, compiles)
                if recs:
                    out += [sources(recs, command, dates), ""]
            png = t.with_name(t.stem.replace("accuracy_", "accuracy_curves_", 1) + ".png")
            if png.exists():
                out += [f"![{t.stem}](../results/tables/{png.name})", ""]
    return "\n".join(out).rstrip() + "\n"


def readme_with_glance(readme: str, res: Path) -> str:
    runs = load_runs(res / "runs")
    bench = [r for r in load(res / "bench") if "batch_size" in r]
    pattern = re.compile(re.escape(GLANCE_START) + ".*?" + re.escape(GLANCE_END), re.S)
    if not pattern.search(readme):
        raise ValueError(f"README.md lacks the markers {GLANCE_START} ... {GLANCE_END}")
    return pattern.sub(lambda _: f"{GLANCE_START}\n{glance(runs, bench)}\n{GLANCE_END}", readme)


def write_pages(res: Path, root: Path):
    """docs/results.md and the README's table, written only when their text changes."""
    from division import results
    page = results_page(res, root)
    target = root / "docs" / "results.md"
    if not target.exists() or target.read_text() != page:
        results.write_text(target, page)
    readme = root / "README.md"
    new = readme_with_glance(readme.read_text(), res)
    if new != readme.read_text():
        results.write_text(readme, new)
    return [target, readme]
