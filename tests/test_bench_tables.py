import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, import_script
from division.maxbatch import find_max_batch, parse_bytes


@pytest.mark.parametrize("limit", [1, 5, 37, 64, 1000])
def test_max_batch_search_finds_known_limit(limit):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= limit
    assert find_max_batch(fits, 1, 4096) == limit
    assert len(calls) < 30


def test_max_batch_none_fit():
    assert find_max_batch(lambda b: False) == 0


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 * 2 ** 30 and parse_bytes("512 MiB") == 512 * 2 ** 20
    with pytest.raises(ValueError, match="budget"):
        parse_bytes("four gigs")


def test_tiny_benchmark_through_subprocess(tmp_path):
    suite = tmp_path / "tiny.yaml"
    suite.write_text("suite: tiny\nmodels: [resnet20]\nbatches: [4]\nmethods: [fp, division]\nimage_size: 32\n"
                     "num_classes: 10\nsteps: 2\nwarmup: 1\n")
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--config", str(suite), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    tmp_path = out
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 2
    recs = [json.loads(f.read_text()) for f in files]
    for rec in recs:
        assert rec["status"] == "ok" and rec["throughput_img_s"] > 0 and rec["act_mem_bytes"] > 0
    div = next(r for r in recs if r["method"] == "division")
    assert div["act_compression"] > 5
    assert all(r["suite"] == "tiny" for r in recs)


def test_paired_throughput_one_process_and_its_table(tmp_path):
    """--paired: every method's steps in one process, one file per (model, batch) with per-round ratios to
    the first method; make_tables lists it in its own table and keeps it out of the memory tables."""
    out = tmp_path / "bench" / "tiny_paired"
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--paired", "--models", "resnet20", "--batches", "4",
                           "--methods", "fp,division", "--image-size", "32", "--num-classes", "10", "--steps", "3",
                           "--warmup", "1", "--suite", "tiny_paired", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads((out / "paired_resnet20_b4.json").read_text())
    assert rec["status"] == "ok" and rec["paired"] and rec["baseline"] == "fp" and "git_sha" in rec
    fp, div = rec["methods"]
    assert fp["method"] == "fp" and fp["relative_to_first"] == 1.0 and len(div["step_times_s"]) == 3
    ratios = sorted(a / b for a, b in zip(fp["step_times_s"], div["step_times_s"]))
    assert div["relative_to_first"] == pytest.approx(ratios[1])
    ref = ROOT / "results" / "reference" / "division_paper_numbers.json"
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / ref.name).write_text(ref.read_text())
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", "--results", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (tmp_path / "tables" / "throughput_paired.md").read_text()
    assert f"| tiny_paired | resnet20 | 4 | division | {div['throughput_img_s']:.2f} |" in table
    assert f"| 3 | {rec['git_sha'][:8]}" in table and "WARNING: rows come from" not in table  # a commit per row
    assert not (tmp_path / "tables" / "memory_tiny_paired.md").exists()


def test_bench_config_rejects_unknown_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("suite: x\nmodel: resnet20\n")
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--config", str(bad)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "unknown keys ['model']" in proc.stderr


def test_suite_method_specs_with_options_stay_apart(tmp_path):
    from division.bench import parse
    suite = tmp_path / "s.yaml"
    suite.write_text('suite: s\nmethods: [fp, "division_plus:fuse_bn_relu=false", "compile_budget:budget=0.5"]\n')
    args = parse(["--config", str(suite)])
    assert args.methods.split(";") == ["fp", "division_plus:fuse_bn_relu=false", "compile_budget:budget=0.5"]


def _fixture(root: Path):
    ref = ROOT / "results" / "reference" / "division_paper_numbers.json"
    (root / "reference").mkdir(parents=True)
    (root / "reference" / ref.name).write_text(ref.read_text())
    bench = root / "bench" / "cpu"
    bench.mkdir(parents=True)
    base = {"suite": "cpu", "amp": "none", "image_size": 224, "device": "cpu: test", "git_sha": "abcdef1234",
            "git_dirty": False}
    rows = [("fp", 4, "ok", 100e6, 4.0), ("division", 4, "ok", 9e6, 3.0), ("fp", 8, "oom", None, None)]
    for method, batch, status, held, speed in rows:
        rec = dict(base, model="resnet50", batch_size=batch, method=method, status=status)
        if status == "ok":
            rec.update(act_mem_bytes=held, act_mem_fp_bytes=100e6, act_compression=100e6 / held,
                       peak_mem_bytes=2e9, peak_mem_growth_bytes=1e9, throughput_img_s=speed)
            if method == "division":  # files from before bf383ac have no ratio without the input
                rec.update(act_compression_without_input=(100e6 - 4e6) / (held - 0.5e6))
        (bench / f"resnet50_b{batch}_{method}.json").write_text(json.dumps(rec))
        small = root / "bench" / "cpu_small"  # the same network with the CIFAR stem at 32x32
        small.mkdir(exist_ok=True)
        (small / f"resnet50_b{batch}_{method}.json").write_text(json.dumps(dict(rec, suite="cpu_small", image_size=32)))
    for rnd, fp_speed, div_speed in [("r1", 4.0, 3.0), ("r2", 5.0, 4.5), ("r3", 6.0, 3.0)]:
        folder = root / "bench" / "cpu_repeat" / rnd
        folder.mkdir(parents=True)
        for method, speed in (("fp", fp_speed), ("division", div_speed)):
            rec = dict(base, model="resnet50", batch_size=8, method=method, status="ok", act_mem_bytes=9e6,
                       act_mem_fp_bytes=100e6, act_compression=100e6 / 9e6, peak_mem_bytes=2e9,
                       peak_mem_growth_bytes=1e9, throughput_img_s=speed)
            (folder / f"resnet50_b8_{method}.json").write_text(json.dumps(rec))
    for exp, method, seed, top1, sha, speed in [("cifar10_resnet20_cpu", "fp", 0, 60.0, "abcdef12", 200.0),
                                                ("cifar10_resnet20_cpu", "fp", 1, 62.0, "abcdef99", 100.0),
                                                ("cifar10_resnet20_cpu", "division", 0, 59.0, "99999999", 120.0),
                                                ("check", "fp", 0, 11.0, "abcdef12", 1.0)]:
        d = root / "runs" / exp / f"{method}-{seed}"
        d.mkdir(parents=True)
        (d / "result.json").write_text(json.dumps({
            "status": "ok", "experiment": exp, "data": "cifar10", "model": "resnet20", "method": method,
            "seed": seed, "top1": top1, "best_top1": top1 + 1,
            "epochs": [{"epoch": e + 1, "top1": top1, "throughput_img_s": s} for e, s in enumerate((speed, speed, 5 * speed))],
            "act_compression": 1.0 if method == "fp" else 9.5, "throughput_img_s": 5 * speed, "device": "cpu: test",
            "git_sha": sha, "git_dirty": False,
            **({"act_compression_without_input": 9.6} if method == "division" else {})}))


def test_tables_from_fixtures(tmp_path):
    _fixture(tmp_path)
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", "--results", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tables = tmp_path / "tables"
    mem = (tables / "memory_cpu.md").read_text()
    assert "oom" in mem and "missing" in mem and "11.11x" in mem
    assert "| 95.4 | 11.11x | 11.29x |" in mem and "| 95.4 | 1.00x | not recorded |" in mem
    assert "0.49 (64) | 10.5x" in mem  # the paper's ImageNet figures beside the 224x224 rows only
    assert "0.49 (64)" not in (tables / "memory_cpu_small.md").read_text()
    # rounds: median speed 3.00, range 3.00-4.50, median of per-round ratios (0.75, 0.90, 0.50) = 0.75
    assert "| cpu_repeat | resnet50 | 8 | division | none | 3.00 | 3.00-4.50 (3) | 0.75 |" in \
        (tables / "throughput.md").read_text()
    acc = (tables / "accuracy_cifar10_resnet20_cpu.md").read_text()
    # fp: last 61.00 ± 1.41, best 62.00 ± 1.41 (n 2); division from one commit, 120 img/s = 0.60 of fp's seed-0
    # run, 200 img/s (speeds: per run the median over epochs, not the last epoch's figure; ratios paired by seed);
    # one run has no std, and its gap is to fp's run of the same seed (60.00), not to fp's mean over seeds 0-1
    assert "| fp | 61.00 ± 1.41 | 62.00 ± 1.41 | 2 | +0.00 |  | 1.00x | 150.0 (1.00) | abcdef12, abcdef99 |" in acc
    assert ("| division | 59.00 | 60.00 | 1 | -1.00 |  | 9.50x (9.60x without input) | 120.0 (0.60) "
            "| 99999999 |") in acc
    assert "11.00" not in acc and not (tables / "accuracy_check.md").exists()  # smoke runs stay out
    assert "WARNING: rows mixing commits or uncommitted code: fp." in acc
    assert "Commit(s): abcdef12." in mem and "WARNING" not in mem
    assert "| cpu | resnet50 |" not in (tables / "throughput.md").read_text()  # single-run suites: memory only
    for name in ("memory_cpu.csv", "memory_cpu.tex", "throughput.md", "throughput.png", "memory_cpu.png",
                 "accuracy_curves_cifar10_resnet20_cpu.png"):
        assert (tables / name).exists(), name


def test_gpu_check_dry_run_composes_every_command():
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    gpu_check = import_script("gpu_check")
    assert proc.stdout.count("ok   ") == len(gpu_check.DEFAULT_STEPS) == 6
    seeds = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--only", "seeds"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert seeds.returncode == 0 and "ok   seeds: scripts/gpu_check.py --seed-shards 4" in seeds.stdout, seeds


def test_gpu_seeds_are_dealt_to_sweeps_side_by_side():
    """The 20 GPU seeds go to 4 sweeps, each seed once, each sweep alternating fp and division per seed (what
    finishes before the time limit stays balanced), each in its own Hydra folder."""
    gpu_check = import_script("gpu_check")
    shards = gpu_check.seed_commands(4, 20, "fp,division")
    seeds = [int(v) for cmd in shards for a in cmd if a.startswith("seed=") for v in a[5:].split(",")]
    assert sorted(seeds) == list(range(20)) and len(shards) == 4
    assert all("method=fp,division" in cmd and cmd.index("experiment=cifar10_fast94_gpu") <
               next(i for i, a in enumerate(cmd) if a.startswith("seed=")) < cmd.index("method=fp,division")
               for cmd in shards)  # the first sweep key varies slowest: methods alternate within a seed
    assert len({a for cmd in shards for a in cmd if a.startswith("hydra.sweep.dir=")}) == 4


def test_gpu_check_keeps_to_its_budget():
    """Each step runs within min(its limit, what is left); a step that overruns is stopped and the next runs;
    a step with no time left is skipped, not started."""
    gpu_check = import_script("gpu_check")
    py = sys.executable
    plan = [("slow", [py, "-c", "import time; time.sleep(30)"], 4),
            ("fails", [py, "-c", "import time; time.sleep(4); raise SystemExit(3)"], 10),
            ("late", [py, "-c", "pass"], 10)]
    done = gpu_check.run_plan(plan, budget=10, reserve=0, min_step=3)  # 6 s left, then about 2
    assert [(n, s.split()[0]) for n, s, _ in done] == [("slow", "TIMEOUT"), ("fails", "FAILED"), ("late", "skipped")]


def test_gpu_check_stops_a_late_step_with_its_children(tmp_path):
    """A step that runs out of time is stopped with every process it started (the benchmark measures each
    configuration in a child process, which must not go on measuring into the next step), and so is what a
    finished step left behind."""
    gpu_check = import_script("gpu_check")
    py = sys.executable
    pids = tmp_path / "pids"
    spawn = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             f"open({str(pids)!r}, 'a').write(str(c.pid) + '\\n'); time.sleep({{}})")
    assert gpu_check.run_step([py, "-c", spawn.format(60)], timeout=3).startswith("TIMEOUT")
    assert gpu_check.run_step([py, "-c", spawn.format(0)], timeout=30) == "ok"
    children = [int(pid) for pid in pids.read_text().split()]
    assert len(children) == 2
    time.sleep(0.5)
    assert not any(_running(pid) for pid in children)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie waiting for its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_max_batch_below_the_start():
    assert find_max_batch(lambda b: b <= 5, start=32) == 5
    assert find_max_batch(lambda b: False, start=8) == 0


def test_paired_differences_and_interval():
    make_tables = import_script("make_tables")
    ok = [{"method": m, "seed": s, "top1": v} for m, s, v in
          [("fp", 0, 90.0), ("fp", 1, 91.0), ("fp", 2, 92.0), ("division", 0, 89.0), ("division", 1, 90.5),
           ("division", 2, 91.0), ("division", 7, 50.0)]]
    seeds, diffs, mean, ci = make_tables.paired_differences(ok, "division", "fp")
    assert seeds == [0, 1, 2] and diffs == [-1.0, -0.5, -1.0]
    half = 4.303 * statistics.stdev(diffs) / math.sqrt(3)
    assert math.isclose(mean, -2.5 / 3) and math.isclose(ci[1], mean + half) and ci[1] < 0
    assert make_tables.paired_differences(ok[:4], "division", "fp")[3] is None


def test_paired_table_answers_the_lfc_actnn_division_plus_and_keep_input_questions(tmp_path):
    make_tables = import_script("make_tables")
    top1 = {"fp": (90.0, 91.0), "division": (89.0, 90.0), "division_nolfc": (89.5, 90.2), "division_plus": (89.4, 90.6),
            "division_keep_input": (89.1, 90.3), "actnn": (88.8, 90.4)}
    ok = [{"method": m, "seed": s, "top1": v[s], "git_sha": "abcdef12", "git_dirty": False}
          for m, v in top1.items() for s in (0, 1)]
    text = make_tables.paired_table(ok, tmp_path, "exp")[0]
    assert "| division - division_nolfc | 0,1 | -0.50, -0.20 | -0.35 |" in text
    assert "| division - actnn | 0,1 | +0.20, -0.40 | -0.10 |" in text
    assert "| division_plus - division | 0,1 | +0.40, +0.60 | +0.50 |" in text
    assert "| division_keep_input - division | 0,1 | +0.10, +0.30 | +0.20 |" in text
    assert "| division_nolfc - fp | 0,1 | -0.50, -0.80 |" in text
    assert "division_plus - division_nolfc" not in text


def test_bench_model_specs_with_options(tmp_path):
    """A model spec may carry options (WRPN's widened network): built as asked, recorded as given, its file
    name free of ':' and '='; a malformed option names itself."""
    from division import bench
    assert bench.model_options("resnet20:width_mult=2") == ("resnet20", {"width_mult": 2})
    with pytest.raises(ValueError, match="width_mult"):
        bench.model_options("resnet20:width_mult")
    model, _, _ = bench._prepared("resnet20:width_mult=2", {"name": "fp"}, 32, 10, torch.device("cpu"))
    assert model.conv1.out_channels == 32
    assert bench._stem("resnet50:stem=cifar", 224) == "cifar" and bench._stem("resnet50", 224) == "imagenet"
    bench.main(["--paired", "--models", "resnet20:width_mult=2", "--batches", "2", "--methods", "fp,wrpn",
                "--image-size", "32", "--num-classes", "10", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    rec = json.loads((tmp_path / "paired_resnet20_width_mult2_b2.json").read_text())
    assert rec["model"] == "resnet20:width_mult=2" and [m["method"] for m in rec["methods"]] == ["fp", "wrpn"]


def test_accuracy_speed_ratios_pair_seed_processor_and_threads(tmp_path):
    """Speed ratios pair a run with fp's run of the same seed on the same processor with the same thread
    count, whatever fp's other runs used."""
    make_tables = import_script("make_tables")

    def run(method, seed, speed, threads, cpu="Intel(R) Xeon(R) Processor"):
        return {"status": "ok", "experiment": "exp", "data": "cifar10", "model": "resnet20", "method": method,
                "seed": seed, "top1": 80.0, "best_top1": 80.0, "epochs": [{"epoch": 1, "top1": 80.0,
                "throughput_img_s": speed}], "act_compression": 10.0, "throughput_img_s": speed,
                "config": {"trainer": {"threads": threads}}, "git_sha": "abcdef12", "git_dirty": False,
                "device": f"cpu: {cpu}, 2 logical cores, {threads} torch threads",
                "_path": f"exp/{method}-{seed}/result.json"}
    ok = [run("fp", 0, 200.0, 1), run("fp", 1, 200.0, 1), run("division", 0, 150.0, 1), run("division", 1, 400.0, 2)]
    text = make_tables.accuracy_table(ok, {}, tmp_path, "exp")[0]
    assert "| 150.0 @Xeon 1 thr; 400.0 @Xeon 2 thr (0.75) [1 of 2 runs] |" in text
    ok += [run("fp", 2, 800.0, 2), run("division", 2, 400.0, 2)]  # fp itself now mixes thread counts
    text = make_tables.accuracy_table(ok, {}, tmp_path, "exp")[0]
    assert "| 150.0 @Xeon 1 thr; 400.0 @Xeon 2 thr (0.62) [2 of 3 runs] |" in text
    assert "| 200.0 @Xeon 1 thr; 800.0 @Xeon 2 thr (1.00) |" in text
    wide = dict(run("wrpn", 0, 50.0, 1), config={"trainer": {"threads": 1}, "model": {"width_mult": 2}},
                act_mem_bytes=250.0, act_mem_fp_bytes=600.0)
    fp_held = [dict(r, act_mem_bytes=200.0 if r["method"] == "fp" else 20.0, act_mem_fp_bytes=200.0) for r in ok]
    text = make_tables.accuracy_table(fp_held + [wide], {}, tmp_path, "exp")[0]  # widened: own row, beside fp's
    assert "| wrpn (2x wide) | 80.00 | 80.00 | 1 | +0.00 |  | 10.00x; 0.80x against fp | 50.0 (0.25) |" in text
    assert "| division | 80.00 ± 0.00 | 80.00 ± 0.00 | 3 | +0.00 | [+0.00, +0.00] | 10.00x |" in text  # fp's network: one ratio
    assert "wrpn (2x wide) - fp" in (tmp_path / "accuracy_exp_paired.md").read_text()
    ok[-1] = run("division", 2, 400.0, 2, cpu="AMD EPYC")  # another machine: no pair for seed 2
    text = make_tables.accuracy_table(ok, {}, tmp_path, "exp")[0]
    assert "| 400.0 @AMD EPYC 2 thr; 150.0 @Xeon 1 thr; 400.0 @Xeon 2 thr (0.75) [1 of 3 runs] |" in text
    ok[-1] = dict(run("division", 2, 4000.0, 4), device="cuda: NVIDIA H200 (convolutions fp32, matmuls fp32)")
    text = make_tables.accuracy_table(ok, {}, tmp_path, "exp")[0]  # a GPU: named with its fp32 precision
    assert "| 4000.0 @NVIDIA H200 fp32; 150.0 @Xeon 1 thr; 400.0 @Xeon 2 thr (0.75) [1 of 3 runs] |" in text


@pytest.mark.parametrize("compact", [False, True])
def test_codec_benchmark_writes_every_row(tmp_path, compact):
    """scripts/bench_codec.py on small maps: a copy_ row per shape and both backends of each codec."""
    out = tmp_path / "codec.json"
    cmd = [sys.executable, "scripts/bench_codec.py", "--batch", "2", "--repeats", "1", "--shapes", "16x16x16,32x7x7",
           "--out", str(out)] + (["--relu-compact"] if compact else [])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["status"] == "ok" and rec["relu_compact"] is compact and rec["git_sha"]
    codecs = {r["codec"] for r in rec["rows"]}
    assert codecs == ({"copy_", "division", "div+cmp"} if compact else {"copy_", "division", "blpa"})
    timed = [r for r in rec["rows"] if r["codec"] != "copy_"]
    assert all(r["encode_ms"] > 0 and r["decode_ms"] > 0 for r in timed)
    assert {r["backend"] for r in timed} >= {"reference"}


def test_codec_benchmark_sweeps_triton_launches(tmp_path):
    """--triton-sweep (Triton's interpreter here) adds a row per launch and shape, each naming its launch, so
    that a device run's file says which way of cutting the kernels into programs was fastest."""
    from division.kernels import triton_codecs
    if triton_codecs.triton is None:
        pytest.skip("Triton is not installed")
    out = tmp_path / "codec.json"
    cmd = [sys.executable, "scripts/bench_codec.py", "--batch", "2", "--repeats", "1", "--shapes", "4x7x7",
           "--triton-sweep", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in json.loads(out.read_text())["rows"] if r["codec"] == "hfc"]
    launches = [(r["launch"]["tile"], r["launch"]["max_rows"], r["launch"]["num_warps"]) for r in rows]
    assert launches == [(4096, 1, 4), (4096, 64, 4), (4096, 64, 8), (1024, 64, 4)]
    assert all(r["encode_ms"] > 0 and r["decode_ms"] > 0 and r["shape"] == [2, 4, 7, 7] for r in rows)


def test_codec_benchmark_rejects_bad_shapes():
    proc = subprocess.run([sys.executable, "scripts/bench_codec.py", "--shapes", "16x16"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "CxHxW" in proc.stderr


def test_budget_runs_are_their_own_method_in_the_tables(tmp_path):
    """A run with method.budget is ``<method>:budget=<b>``, a row of its own, not another seed of the method."""
    results_pages = import_script("results_pages")
    for i, (name, budget) in enumerate([("division_plus", None), ("division_plus", "20x"), ("fp", "")]):
        folder = tmp_path / "exp" / f"run{i}"
        folder.mkdir(parents=True)
        rec = {"status": "ok", "epochs": [], "method": name, "config": {"method": {"name": name, "budget": budget}}}
        (folder / "result.json").write_text(json.dumps(rec))
    assert [r["method"] for r in results_pages.load_runs(tmp_path)] == ["division_plus", "division_plus:budget=20x",
                                                                         "fp"]


def test_budget_runs_are_paired_against_division(tmp_path):
    """The paired table answers a budget's question: its runs minus DIVISION's of the same seeds."""
    make_tables = import_script("make_tables")
    ok = [{"method": m, "seed": s, "top1": top1 + s / 10, "git_sha": "abc", "git_dirty": False, "epochs": []}
          for m, top1 in (("fp", 90.0), ("division", 89.5), ("division_plus:budget=20x", 89.0)) for s in (0, 1)]
    (table,) = make_tables.paired_table(ok, tmp_path, "exp")
    text = (tmp_path / "accuracy_exp_paired.md").read_text()
    assert "| division_plus:budget=20x - division | 0,1 | -0.50, -0.50 | -0.50 |" in text
    assert "| division_plus:budget=20x - fp | 0,1 | -1.00, -1.00 | -1.00 |" in text


def test_autocast_rows_measure_what_fp32_training_holds(tmp_path):
    """Under autocast a row also records fp32 training's activations (the paper's vanilla baseline), measured:
    equal to the bytes an fp32 run of the same step holds, byte for byte, and about twice the bf16 reference;
    the GPU table and the README show the ratio against it beside the one against fp in the autocast dtype."""
    from division import bench
    mixed = bench.measure("resnet20", 4, "division", 32, 1, 1, "cpu", "bf16", 10)
    fp32 = bench.measure("resnet20", 4, "fp", 32, 1, 1, "cpu", "none", 10)
    assert mixed["act_mem_fp32_bytes"] == fp32["act_mem_fp_bytes"]
    assert mixed["act_mem_fp32_bytes"] > 1.9 * mixed["act_mem_fp_bytes"]
    assert mixed["act_compression_fp32"] == mixed["act_mem_fp32_bytes"] / mixed["act_mem_bytes"]
    assert "act_mem_fp32_bytes" not in fp32  # without autocast the reference is fp32 already
    _fixture(tmp_path)
    gpu = tmp_path / "bench" / "gpu_test"
    gpu.mkdir(parents=True)
    base = {"suite": "gpu_test", "amp": "fp16", "image_size": 224, "device": "cuda: Test GPU", "git_sha": "abcdef1234",
            "git_dirty": False, "model": "resnet50", "batch_size": 256, "status": "ok", "peak_mem_bytes": 2e9}
    for method, held, speed in (("fp", 10e9, 3000.0), ("division", 1e9, 2700.0)):
        rec = dict(base, method=method, act_mem_bytes=held, act_mem_fp_bytes=10e9, act_compression=10e9 / held,
                   act_mem_fp32_bytes=20e9, act_compression_fp32=20e9 / held, throughput_img_s=speed)
        (gpu / f"resnet50_b256_{method}_fp16.json").write_text(json.dumps(rec))
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", "--results", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (tmp_path / "tables" / "gpu_test.md").read_text()
    assert "| resnet50 | 256 | division | fp16 | 953.7 | 10.00x | 20.00x | 1907 | 2700.0 | 0.90 |" in table
