"""Memory and throughput benchmark: each (model, batch, method) runs in a fresh subprocess so that peak
memory and allocator state never leak between configurations. One JSON file per configuration.

    python scripts/bench.py --models resnet50 --batches 4,8 --methods fp,division --out results/bench/cpu
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from division import engine, methods, results
from division.models import create_model

ROOT = Path(__file__).resolve().parents[2]


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _method_cfg(spec: str) -> dict:
    """'division' or 'division:hfc_bits=4,block_size=4' -> a method config dict."""
    name, _, opts = spec.partition(":")
    cfg = {"name": name}
    if name == "division_nolfc":
        cfg = {"name": name, "kind": "division", "lfc": False}
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        cfg[key] = json.loads(value) if value[:1] in "-0123456789tf[" else value
    return cfg


def measure(model_name: str, batch: int, method_spec: str, image_size: int, steps: int, warmup: int,
            device_name: str, amp: str, num_classes: int = 1000, fp_reference: bool = True) -> dict:
    """One configuration in this process: warm-up, then ``steps`` timed training steps."""
    device = torch.device("cuda" if device_name == "auto" and torch.cuda.is_available() else
                          ("cpu" if device_name == "auto" else device_name))
    torch.manual_seed(0)
    model = create_model(model_name, num_classes=num_classes).to(device)
    method = methods.build(_method_cfg(method_spec))
    method.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    y = torch.randint(0, num_classes, (batch,), device=device)
    state = engine.StepState(device, amp)

    def forward():
        with engine.autocast(state):
            return F.cross_entropy(model(x), y)

    def step(account=False):
        opt.zero_grad(set_to_none=True)
        if account:
            with method.accounting() as acc:
                loss = forward()
        else:
            loss = forward()
        loss.backward()
        opt.step()
        return acc.report if account else None

    # the reference forward raises the process's peak, so the max-batch search leaves it out
    fp_bytes = method.fp_reference_bytes(model, forward) if fp_reference else None
    engine.reset_peak(device)
    base_rss = rss_bytes()
    base_alloc = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    report = step(account=True)
    for _ in range(max(0, warmup - 1)):
        step()
    times = []
    for _ in range(steps):
        engine.synchronize(device)
        t0 = time.perf_counter()
        step()
        engine.synchronize(device)
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        peak_growth = peak - base_alloc
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak_growth = max(0, peak - base_rss)
    median = statistics.median(times)
    return {
        "status": "ok", "act_mem_bytes": report.held_bytes, "act_mem_fp_bytes": fp_bytes,
        "act_compression": fp_bytes / max(report.held_bytes, 1) if fp_bytes else None,
        "act_mem_host_bytes": report.host_bytes,
        "act_mem_by_codec": report.by_codec(), "peak_mem_bytes": int(peak), "peak_mem_growth_bytes": int(peak_growth),
        "throughput_img_s": batch / median, "step_times_s": times, "notes": report.notes,
        "device": results.device_description(device),
    }


def out_path(out_dir: Path, model: str, batch: int, method: str, amp: str) -> Path:
    safe = method.replace(":", "_").replace(",", "_").replace("=", "")
    return out_dir / f"{model}_b{batch}_{safe}{'' if amp == 'none' else '_' + amp}.json"


def run_one_subprocess(args, model, batch, method, path: Path) -> dict:
    cmd = [sys.executable, "-m", "division.bench", "--single", "--models", model, "--batches", str(batch),
           "--methods", method, "--image-size", str(args.image_size), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--device", args.device, "--amp", args.amp, "--num-classes", str(args.num_classes), "--suite", args.suite,
           "--out", str(path)] + ([] if args.fp_reference else ["--no-fp-reference"])
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    if path.exists():
        return results.read_json(path)
    tail = (proc.stderr or proc.stdout)[-2000:]
    status = "oom" if ("out of memory" in tail.lower() or proc.returncode in (-9, 137)) else "error"
    record = {"status": status, "returncode": proc.returncode, "error": tail}
    record.update(_identity(args, model, batch, method))
    results.write_json(path, record)
    return record


def _identity(args, model, batch, method):
    return {"model": model, "batch_size": batch, "method": method, "image_size": args.image_size,
            "amp": args.amp, "steps": args.steps, "warmup": args.warmup, "suite": args.suite}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a suite file from configs/bench/ (flags given after it win)")
    p.add_argument("--models", default="resnet50")
    p.add_argument("--batches", default="4,8")
    p.add_argument("--methods", default="fp,checkpoint,swap,blpa,actnn,division")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", default="none", choices=list(engine.AMP_DTYPES))
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--suite", default="cpu")
    p.add_argument("--out", default=None, help="output folder (default results/bench/<suite>); a file with --single")
    p.add_argument("--force", action="store_true", help="rerun configurations whose file exists")
    p.add_argument("--no-fp-reference", dest="fp_reference", action="store_false",
                   help="skip the full-precision reference forward (peak-memory probes)")
    p.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.config:
        from omegaconf import OmegaConf
        suite = OmegaConf.to_container(OmegaConf.load(args.config))
        unknown = sorted(set(suite) - set(vars(args)))
        if unknown:
            raise SystemExit(f"{args.config}: unknown keys {unknown}; valid keys: {sorted(vars(args))}")
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])
                 if a.startswith("--")}
        for key, value in suite.items():
            if key not in given:
                setattr(args, key, ",".join(map(str, value)) if isinstance(value, list) else value)
    return args


def main(argv=None):
    args = parse(argv)
    models = args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    method_specs = [m for m in args.methods.split(";" if ":" in args.methods else ",")]
    if args.single:
        path = Path(args.out)
        try:
            record = measure(models[0], batches[0], method_specs[0], args.image_size, args.steps, args.warmup,
                             args.device, args.amp, args.num_classes, args.fp_reference)
        except torch.cuda.OutOfMemoryError as err:
            record = {"status": "oom", "error": str(err)[:500]}
        record.update(_identity(args, models[0], batches[0], method_specs[0]))
        results.write_json(path, record)
        return
    out_dir = Path(args.out or ROOT / "results" / "bench" / args.suite)
    for model in models:
        for batch in batches:
            for method in method_specs:
                path = out_path(out_dir, model, batch, method, args.amp)
                if path.exists() and not args.force:
                    print(f"skip {path.name} (exists)")
                    continue
                rec = run_one_subprocess(args, model, batch, method, path)
                if rec["status"] == "ok":
                    print(f"{model:16s} b{batch:<4d} {method:12s} held {rec['act_mem_bytes'] / 2**20:9.1f} MiB  "
                          f"fp {rec['act_mem_fp_bytes'] / 2**20:9.1f} MiB  {rec['act_compression']:6.2f}x  "
                          f"{rec['throughput_img_s']:8.2f} img/s", flush=True)
                else:
                    print(f"{model:16s} b{batch:<4d} {method:12s} {rec['status']}", flush=True)


if __name__ == "__main__":
    main()
