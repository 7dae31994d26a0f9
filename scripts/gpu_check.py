"""One prepared run of every GPU check, within about 8 minutes on one GPU. Everything goes under results/
labelled with the device name:

  1. the CUDA and Triton tests (pytest -m cuda, tests/test_triton.py on the real kernels);
  2. the paper's setting: resnet50 at batch 64 and 256, fp16 autocast, fp / checkpoint / sac / actnn / division / division_plus:
     activation memory, peak memory, throughput (results/bench/gpu_<device>/);
  3. the largest batch for fp and division under a memory cap (results/max_batch/gpu_<device>/);
  4. a short ResNet-18 run, fp vs division (CIFAR-10 when $DATA_DIR has it, else synthetic data; results/runs/).

    python scripts/gpu_check.py            # on the GPU machine (scripts/gpu_check.sh wraps it)
    python scripts/gpu_check.py --dry-run  # on CPU: checks that every command composes, runs nothing
"""
import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def device_tag() -> str:
    import torch
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def steps(tag: str, data_dir):
    py = sys.executable
    bench_out = f"results/bench/gpu_{tag}"
    cifar = ["data=cifar10"] if data_dir and (Path(data_dir) / "cifar10_jpeg.tar.gz").exists() else \
        ["data=synthetic", "data.image_size=32", "data.train_size=2048", "data.test_size=512"]
    train = [py, "train.py", "-m", "model=resnet18", "method=fp,division", "trainer.epochs=2", "data.batch_size=256",
             "trainer.amp=fp16", f"exp_name=gpu_check_{tag}", "paths.runs_dir=${paths.results_dir}/runs",
             "trainer.progress=false", *cifar]
    return [
        ("tests", [py, "-m", "pytest", "-q", "-m", "cuda or not slow", "tests/test_cuda.py", "tests/test_triton.py"], 180),
        ("paper setting", [py, "scripts/bench.py", "--models", "resnet50", "--batches", "64,256", "--methods",
                           "fp,checkpoint,sac,actnn,division,division_plus", "--amp", "fp16", "--steps", "10", "--warmup", "3",
                           "--device", "cuda", "--suite", f"gpu_{tag}", "--out", bench_out], 240),
        ("max batch", [py, "scripts/max_batch.py", "--model", "resnet50", "--methods", "fp,division", "--budget",
                       "8GiB", "--device", "cuda", "--start", "32", "--out", f"results/max_batch/gpu_{tag}"], 180),
        ("cifar resnet18", train, 150),
    ]


def dry_run(plan):
    """Every train.py command composes with Hydra; every script's arguments parse."""
    from hydra import compose, initialize_config_dir
    from division import bench, maxbatch
    for name, cmd, _ in plan:
        if cmd[1] == "train.py":
            sweeps = [a for a in cmd[2:] if a != "-m"]
            fixed = [a for a in sweeps if "," not in a.split("=", 1)[-1] or a.startswith("paths.")]
            for method in ("fp", "division"):
                with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "configs")):
                    compose("train", overrides=[a for a in fixed if not a.startswith("method=")] + [f"method={method}"])
        elif cmd[1] == "scripts/bench.py":
            bench.parse(cmd[2:])
        elif cmd[1] == "scripts/max_batch.py":
            maxbatch.parse(cmd[2:])
        print(f"ok   {name}: {' '.join(cmd[1:])}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    tag = "dry_run" if args.dry_run else device_tag()
    plan = steps(tag, os.environ.get("DATA_DIR"))
    if args.dry_run:
        dry_run(plan)
        return
    failed = []
    for name, cmd, limit in plan:
        start = time.time()
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        try:
            rc = subprocess.run(cmd, cwd=ROOT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"== {name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {time.time() - start:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    subprocess.run([sys.executable, "scripts/make_tables.py"], cwd=ROOT)
    print("failed: " + ", ".join(failed) if failed else "all GPU checks ran")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
