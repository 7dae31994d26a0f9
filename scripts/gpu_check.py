"""One prepared run of every GPU check, inside a time budget (default 530 s, under the 9 minutes a device
call is planned for), every result labelled with the device's name:

  1. tests: the CUDA and Triton tests on the hardware (tests/test_cuda.py, test_triton.py, test_gpu_path.py);
  2. paper: ResNet-50 at 224, fp16 autocast, batch 256 then 64 and 128: activation memory, peak memory and
     throughput of fp / checkpoint / sac / actnn / division / division_plus (results/bench/gpu_<device>/);
  3. paired: DIVISION's and DIVISION+'s throughput against fp's, interleaved steps in one process, batch 256;
  4. codec: encode/decode speed against copy_ of the same fp16 tensor (results/codec/codec_gpu_<device>.json);
  5. max batch: fp and division under one memory cap, fp16 (results/max_batch/gpu_<device>/);
  6. profile: where one DIVISION step's time goes at batch 256 (results/profile/);
  7. seeds (only with --only seeds, a call of its own): the fast CIFAR-10 recipe, fp and division alternating,
     seeds 0-19 in 4 sweeps side by side (experiment=cifar10_fast94_gpu; the data travels in .whl/data, see
     scripts/device/prepare.sh);
  8. compile (only with --only compile): torch.compile'd DIVISION / compiled fp against the eager ratio,
     ResNet-50 at batch 256, fp16, the codec through the Triton operators and traced for Inductor
     (method.backend=reference) (results/compile/<device>_resnet50_b256_fp16.json);
  9. compile profile (with 8: --only "compile,compile profile"): where one compiled DIVISION step's time goes.

Each step has its own time limit, cut to what is left of the budget; a step that fails or runs out of time
leaves what it finished (each benchmark configuration is its own file) and the next step runs.

    python scripts/gpu_check.py                  # on the GPU machine (scripts/device/run.sh wraps it)
    python scripts/gpu_check.py --only tests,paper --budget 300
    python scripts/gpu_check.py --dry-run        # anywhere: every command composes and parses, nothing runs
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PAPER_METHODS = "fp,checkpoint,sac,actnn,division,division_plus"


def steps(tag: str, force: bool = False):
    """(name, command, time limit in seconds) in the order they run: the issue's priorities first. Benchmark
    configurations whose result file exists are skipped (a rerun fills in what is missing) unless ``force``
    (a remeasurement after a code change: the files record the new commit)."""
    py = sys.executable
    bench = [py, "scripts/bench.py", "--models", "resnet50", "--amp", "fp16", "--device", "cuda",
             "--suite", f"gpu_{tag}", "--out", f"results/bench/gpu_{tag}"] + (["--force"] if force else [])
    return [
        ("tests", [py, "-m", "pytest", "-q", "-m", "cuda or not slow", "-p", "no:cacheprovider",
                   "tests/test_cuda.py", "tests/test_triton.py", "tests/test_gpu_path.py"], 140),
        ("paper", bench + ["--batches", "256,64,128", "--methods", PAPER_METHODS, "--steps", "8", "--warmup", "3"],
         220),
        ("paired", bench + ["--batches", "256", "--methods", "fp,division,division_plus", "--paired", "--steps", "12",
                            "--warmup", "3"], 60),
        ("codec", [py, "scripts/bench_codec.py", "--device", "cuda", "--dtype", "fp16", "--batch", "64",
                   "--repeats", "20", "--triton-sweep"], 90),
        ("max batch", [py, "scripts/max_batch.py", "--model", "resnet50", "--methods", "fp,division", "--amp", "fp16",
                       "--budget", "16GiB", "--device", "cuda", "--start", "64", "--limit", "2048",
                       "--out", f"results/max_batch/gpu_{tag}"], 120),
        ("profile", [py, "scripts/profile_step.py", "--model", "resnet50", "--method", "division", "--batch", "256",
                     "--amp", "fp16", "--device", "cuda"], 40),
        ("seeds", [py, "scripts/gpu_check.py", "--seed-shards", str(SEED_SHARDS)], 560),
        ("compile", [py, "scripts/compile_check.py", "--model", "resnet50", "--batch", "256", "--image-size", "224",
                     "--methods", "division,division:backend=reference", "--amp", "fp16", "--device", "cuda",
                     "--rounds", "10"], 420),
        ("compile profile", [py, "scripts/profile_step.py", "--model", "resnet50", "--method", "division", "--batch",
                             "256", "--amp", "fp16", "--device", "cuda", "--compile"], 100),
    ]


DEFAULT_STEPS = ("tests", "paper", "paired", "codec", "max batch", "profile")  # seeds, compile: calls of their own
SEEDS, SEED_METHODS, SEED_SHARDS = 20, "fp,division", 4


def seed_commands(shards: int = SEED_SHARDS, seeds: int = SEEDS, methods: str = SEED_METHODS):
    """The GPU seeds of the fast CIFAR-10 recipe as ``shards`` Hydra sweeps run side by side: one fast94 run is
    bound by its host thread and leaves the GPU idle between kernels. Seeds are dealt round-robin and each
    sweep alternates the methods per seed, so whatever has finished when time runs out is balanced across
    methods; each sweep writes its own Hydra folder (sweeps started in the same second would share one)."""
    return [[sys.executable, "train.py", "-m", "experiment=cifar10_fast94_gpu",
             f"seed={','.join(str(s) for s in range(k, seeds, shards))}", f"method={methods}", "logger=none",
             "trainer.progress=false", f"hydra.sweep.dir=multirun/gpu_seeds/shard{k}"] for k in range(shards)]


def run_seed_shards(shards: int) -> int:
    """Run :func:`seed_commands` at once and wait for all; the exit status is the worst of theirs. The step's
    time limit stops them all (run_step kills its process group)."""
    procs = [subprocess.Popen(cmd, cwd=ROOT) for cmd in seed_commands(shards)]
    return max(proc.wait() for proc in procs)


def dry_run(plan):
    """Every script's arguments parse, and the pytest selection collects, without a GPU."""
    import importlib
    sys.path.insert(0, str(ROOT / "scripts"))
    from division import bench, maxbatch
    for name, cmd, _ in plan:
        script = cmd[1]
        if script == "scripts/bench.py":
            bench.parse(cmd[2:])
        elif script == "scripts/max_batch.py":
            maxbatch.parse(cmd[2:])
        elif script == "scripts/gpu_check.py":  # the seeds' sweeps: each composes
            for shard in seed_commands(int(cmd[cmd.index("--seed-shards") + 1])):
                _compose_sweep(shard)
        elif script == "-m":
            rc = subprocess.run(cmd[:3] + ["--collect-only"] + cmd[3:], cwd=ROOT, capture_output=True).returncode
            if rc != 0:
                raise SystemExit(f"{name}: pytest cannot collect {' '.join(cmd[2:])}")
        else:
            importlib.import_module(Path(script).stem).parse(cmd[2:])
        print(f"ok   {name}: {' '.join(cmd[1:])}")


def _compose_sweep(cmd):
    """Compose a ``train.py -m`` command's config for its first job (sweep lists and Hydra's own keys left out)."""
    from hydra import compose, initialize_config_dir
    from division import CONFIG_DIR
    overrides = [a for a in cmd[3:] if "," not in a and not a.startswith("hydra.")]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        compose("train", overrides=overrides + ["method=fp", "seed=0"])


def run_step(cmd, timeout: float) -> str:
    """Run one step in a process group of its own; past ``timeout`` the whole group is killed. The benchmark
    measures each configuration in a child process: killing the step's own process alone left that child
    running on the GPU into the next step's measurements."""
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
        return "ok" if rc == 0 else f"FAILED (exit {rc})"
    except subprocess.TimeoutExpired:
        return "TIMEOUT (finished parts kept)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the step left running (its children), or all of it
        except ProcessLookupError:
            pass
        proc.wait()


def run_plan(plan, budget: float, reserve: float = 10.0, min_step: float = 15.0):
    """Run each step within min(its limit, what is left of the budget less ``reserve``); a step with less than
    ``min_step`` seconds left is skipped. Returns [(name, status, seconds)]."""
    start = time.time()
    done = []
    for name, cmd, limit in plan:
        left = budget - (time.time() - start) - reserve
        if left < min_step:
            done.append((name, "skipped (budget spent)", 0.0))
            print(f"== {name}: skipped, {left:.0f} s left of the budget", flush=True)
            continue
        t0 = time.time()
        print(f"== {name} (limit {min(limit, left):.0f} s): {' '.join(cmd[1:])}", flush=True)
        status = run_step(cmd, min(limit, left))
        done.append((name, status, time.time() - t0))
        print(f"== {name}: {status} in {time.time() - t0:.0f} s", flush=True)
    return done


def summary(tag: str, done) -> str:
    """One screen: each step's status, then the headline figures read back from the result files."""
    lines = [f"device {tag}"] + [f"{name:10s} {status} ({sec:.0f} s)" for name, status, sec in done]
    for f in sorted((ROOT / "results" / "bench" / f"gpu_{tag}").glob("*.json")):
        r = json.loads(f.read_text())
        if r.get("status") == "ok" and "act_compression" in r:
            lines.append(f"b{r.get('batch_size')} {r.get('method'):14s} {r['act_compression']:6.2f}x "
                         f"held {r['act_mem_bytes'] / 2**20:8.0f} MiB peak {r['peak_mem_bytes'] / 2**20:7.0f} MiB "
                         f"{r['throughput_img_s']:8.1f} img/s")
        elif r.get("methods"):
            lines += [f"paired b{r.get('batch_size')} {m['method']:14s} {m['relative_to_first']:.3f} of fp"
                      for m in r["methods"]]
        else:
            lines.append(f"{f.name}: {r.get('status')}")
    codec = ROOT / "results" / "codec" / f"codec_gpu_{tag}.json"
    if codec.exists():
        for row in json.loads(codec.read_text())["rows"]:
            if "encode_vs_copy" in row:
                launch = " ".join(f"{k} {v}" for k, v in row.get("launch", {}).items())
                lines.append(f"codec {row['codec']:8s} {row['backend']:9s} {row['shape']} {launch} enc/copy "
                             f"{row['encode_vs_copy']:.2f} dec/copy {row['decode_vs_copy']:.2f}")
    for f in sorted((ROOT / "results" / "max_batch" / f"gpu_{tag}").glob("*.json")):
        r = json.loads(f.read_text())
        lines.append(f"max batch {r['method']}: {r['max_batch']} within {r['budget']}")
    for f in sorted((ROOT / "results" / "compile").glob(f"{tag}_*.json")):
        r = json.loads(f.read_text())
        lines += [f"compile b{r['batch_size']} {key:20s} {v['img_s']:8.1f} img/s, {v['relative_to_fp_same_mode']:.3f} of fp"
                  for key, v in r.get("speed", {}).items()]
        lines += [f"compile b{r['batch_size']} {m['method']}{' compiled' if m['compiled'] else ''}: "
                  f"{m['graph_breaks']} breaks, {m['ratio']}x" for m in r.get("memory", [])]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--budget", type=float, default=530.0, help="seconds for all steps together")
    p.add_argument("--only", default="", help="comma-separated step names (default: all but seeds)")
    p.add_argument("--summary", default=None, help="also write the summary to this file")
    p.add_argument("--force", action="store_true", help="remeasure benchmark configurations that have a file")
    p.add_argument("--seed-shards", type=int, default=0, help=argparse.SUPPRESS)  # the seeds step's own command
    args = p.parse_args(argv)
    if args.seed_shards:
        sys.exit(run_seed_shards(args.seed_shards))
    import torch
    from division.results import device_tag
    plan = steps("dry_run" if args.dry_run else device_tag(torch.device("cuda")), args.force)
    names = {n for n, _, _ in plan}
    wanted = set(args.only.split(",")) if args.only else set(DEFAULT_STEPS)
    if wanted - names:
        raise SystemExit(f"--only: unknown steps {sorted(wanted - names)}; valid choices: {sorted(names)}")
    plan = [s for s in plan if s[0] in wanted]
    if args.dry_run:
        dry_run(plan)
        return
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run this on the GPU machine, or use --dry-run here")
    tag = device_tag(torch.device("cuda"))
    done = run_plan(plan, args.budget)
    text = summary(tag, done)
    print(text)
    if args.summary:
        Path(args.summary).write_text(text)
    sys.exit(0 if all(s == "ok" for _, s, _ in done) else 1)


if __name__ == "__main__":
    main()
