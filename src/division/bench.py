"""Memory and throughput benchmark: each (model, batch, method) runs in a fresh subprocess so that peak
memory and allocator state never leak between configurations. One JSON file per configuration.

    python scripts/bench.py --models resnet50 --batches 4,8 --methods fp,division --out results/bench/cpu
"""
import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from division import engine, methods, results
from division.peak import PeakMeter, release_freed_memory, reuse_freed_memory
from division.models import create_model, stem_of

ROOT = Path(__file__).resolve().parents[2]


def _device(device_name: str) -> torch.device:
    """``auto``: CUDA where available, else the CPU."""
    if device_name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device_name)


def model_options(spec: str):
    """``name`` or ``name:key=value,...`` (e.g. ``resnet20:width_mult=2``, WRPN's widening) -> (name, options)."""
    from omegaconf import OmegaConf
    name, _, opts = spec.partition(":")
    items = [item for item in opts.split(",") if item]
    bad = [item for item in items if "=" not in item]
    if bad:
        raise ValueError(f"model option(s) {bad} are not key=value (in {spec!r})")
    return name, OmegaConf.to_container(OmegaConf.from_dotlist(items))


def _safe(spec: str) -> str:
    """A model or method spec as a file-name part."""
    return spec.replace(":", "_").replace(",", "_").replace("=", "")


def _stem(spec: str, image_size: int) -> str:
    name, options = model_options(spec)
    return stem_of(name, options.get("stem", "auto"), image_size)


def _prepared(model_spec: str, method_cfg: dict, image_size: int, num_classes: int, device: torch.device):
    """(model, method, optimizer) as every benchmark row starts them: seed 0, the method installed, SGD."""
    torch.manual_seed(0)
    name, options = model_options(model_spec)
    model = create_model(name, **{"num_classes": num_classes, "stem": "auto", "image_size": image_size, **options})
    model = model.to(device)
    method = methods.build(method_cfg)
    method.prepare(model)
    model.train()
    return model, method, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def step_state(device: torch.device, amp: str) -> engine.StepState:
    return engine.StepState(device, amp, scaler=torch.amp.GradScaler("cuda") if amp == "fp16" else None)


def calibrate(model, method, batch: int, image_size: int, num_classes: int, device, state):
    """A method with ``method.budget`` plans its precision from one observed step on a batch of its own (as the
    runner does on the first training batch) before anything is measured; other methods: nothing."""
    if getattr(method, "budget", None) is None:
        return
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch, 3, image_size, image_size, generator=g).to(device)
    y = torch.randint(0, num_classes, (batch,), generator=g).to(device)
    method.calibrate(model, engine._forward(model, x, y, state))


def fp32_reference(model, method, x, y, state: engine.StepState):
    """Under autocast, what fp32 training of the same step would hold (``engine.fp_reference`` with autocast
    off: measured, holding nothing): the DIVISION paper's vanilla baseline, whose activations are fp32, while
    the run's own ratio is against fp's activations in the autocast dtype. None without autocast (the
    full-precision reference is fp32 already)."""
    if state.amp == "none":
        return None
    return engine.fp_reference(model, method, x, y, dataclasses.replace(state, amp="none"))


def measure(model_name: str, batch: int, method_spec: str, image_size: int, steps: int, warmup: int,
            device_name: str, amp: str, num_classes: int = 1000, fp_reference: bool = True,
            release_memory: bool = True) -> dict:
    """One configuration in this process, with the runner's own step (``engine.train_step``) and its peak
    rules: the full-precision reference (untimed, holds nothing), then an accounted step and one more (the
    optimizer state then exists); their peak is the peak reported (on CPU measured with glibc returning freed
    blocks), its growth is over the memory in use just before them (weights, inputs). Then ``warmup - 1``
    untimed steps and ``steps`` timed ones with the allocator's fast setting."""
    device = _device(device_name)
    method_cfg = methods.load_config(method_spec)
    model, method, opt = _prepared(model_name, method_cfg, image_size, num_classes, device)
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    y = torch.randint(0, num_classes, (batch,), device=device)
    state = step_state(device, amp)
    calibrate(model, method, batch, image_size, num_classes, device, state)
    live = release_freed_memory() if device.type == "cpu" and release_memory else False
    fp = engine.fp_reference(model, method, x, y, state) if fp_reference else None
    fp32 = fp32_reference(model, method, x, y, state) if fp_reference else None
    meter = PeakMeter(device)
    meter.reset()
    report = engine.train_step(model, method, x, y, opt, None, state, account=True).report
    engine.train_step(model, method, x, y, opt, None, state)  # the optimizer state exists from here on
    peak, growth = meter.peak(), meter.growth()
    if live:
        reuse_freed_memory()
    for _ in range(max(0, warmup - 1)):
        engine.train_step(model, method, x, y, opt, None, state)
    times = [engine.train_step(model, method, x, y, opt, None, state).seconds for _ in range(steps)]
    median = statistics.median(times)
    if fp:
        report.use_fp_reference(fp)
    summary = report.summary()
    return {
        "status": "ok", "act_mem_bytes": report.held_bytes, "act_mem_fp_bytes": report.fp_bytes if fp else None,
        "act_compression": report.fp_bytes / max(report.held_bytes, 1) if fp else None,
        **({k: summary[k] for k in ("act_mem_input_bytes", "act_mem_input_fp_bytes", "act_compression_without_input")}
           if fp else {}),
        **({"act_mem_fp32_bytes": fp32.act_bytes, "act_compression_fp32": fp32.act_bytes / max(report.held_bytes, 1)}
           if fp32 else {}),
        "act_mem_host_bytes": report.host_bytes, "amp_weight_cast_bytes": report.amp_weight_cast_bytes,
        "act_mem_by_codec": report.by_codec(), "peak_mem_bytes": peak, "peak_mem_growth_bytes": growth,
        "peak_mem_how": meter.describe() + "; first 2 steps" + ("; glibc returning freed blocks >= 64 KiB" if live
                                                                 else ""),
        "throughput_img_s": batch / median, "step_times_s": times, "notes": report.notes,
        "method_config": method_cfg, "codec_backends": report.backends,
        **results.provenance(device),
    }


def measure_paired(model_name: str, batch: int, method_specs, image_size: int, steps: int, warmup: int,
                   device_name: str, amp: str, num_classes: int = 1000) -> dict:
    """Throughput of several methods taken in one process, step by step: one model per method (same initial
    weights, same batch), and in each round every method runs one timed step, in alternating order, so that
    a slow spell of a shared machine hits all of them alike. Each round's ratio fp-time / method-time is
    a paired measurement; the record gives their median and quartiles. Throughput only: memory needs a
    process per configuration (``measure``)."""
    device = _device(device_name)
    if device.type == "cpu":
        reuse_freed_memory()
    x = torch.randn(batch, 3, image_size, image_size, generator=torch.Generator().manual_seed(1)).to(device)
    y = torch.randint(0, num_classes, (batch,), generator=torch.Generator().manual_seed(2)).to(device)
    state = step_state(device, amp)
    runs = [(spec, *_prepared(model_name, methods.load_config(spec), image_size, num_classes, device))
            for spec in method_specs]
    for _, model, method, _ in runs:
        calibrate(model, method, batch, image_size, num_classes, device, state)
    times = {spec: [] for spec in method_specs}
    for k in range(warmup + steps):
        for spec, model, method, opt in (runs if k % 2 == 0 else runs[::-1]):
            seconds = engine.train_step(model, method, x, y, opt, None, state).seconds
            if k >= warmup:
                times[spec].append(seconds)
    base = times[method_specs[0]]
    rows = []
    for spec in method_specs:
        ratios = [b / t for b, t in zip(base, times[spec])]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        rows.append({"method": spec, "throughput_img_s": batch / statistics.median(times[spec]),
                     "step_times_s": times[spec], "relative_to_first": statistics.median(ratios),
                     "relative_q1": q1, "relative_q3": q3})
    return {"status": "ok", "paired": True, "baseline": method_specs[0], "methods": rows, **results.provenance(device)}


def out_path(out_dir: Path, model: str, batch: int, method: str, amp: str) -> Path:
    return out_dir / f"{_safe(model)}_b{batch}_{_safe(method)}{'' if amp == 'none' else '_' + amp}.json"


def run_one_subprocess(args, model, batch, method, path: Path) -> dict:
    cmd = [sys.executable, "-m", "division.bench", "--single", "--models", model, "--batches", str(batch),
           "--methods", method, "--image-size", str(args.image_size), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--device", args.device, "--amp", args.amp, "--num-classes", str(args.num_classes), "--suite", args.suite,
           "--out", str(path)] + ([] if args.fp_reference else ["--no-fp-reference"]) + \
        (["--glibc-default"] if args.glibc_default else [])
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
            "stem": _stem(model, args.image_size), "amp": args.amp, "steps": args.steps, "warmup": args.warmup, "suite": args.suite}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a suite file from src/division/configs/bench/ (flags given after it win)")
    p.add_argument("--models", default="resnet50", help="comma-separated; with options, ';'-separated specs "
                                                         "such as resnet20:width_mult=2")
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
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every configuration this many times, interleaved (round k: the whole grid, "
                        "into <out>/r<k>/), so that slow spells of a shared machine hit every method alike")
    p.add_argument("--out", default=None, help="output folder (default results/bench/<suite>); a file with --single")
    p.add_argument("--force", action="store_true", help="rerun configurations whose file exists")
    p.add_argument("--no-fp-reference", dest="fp_reference", action="store_false",
                   help="skip the full-precision reference forward (peak-memory probes)")
    p.add_argument("--glibc-default", action="store_true",
                   help="CPU: keep glibc's default malloc (its cached free memory then inflates the peak)")
    p.add_argument("--paired", action="store_true",
                   help="throughput only: all methods of a (model, batch) in one process, step by step in "
                        "alternating order, ratios to the first method per round (one file per model and batch)")
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
                if isinstance(value, list):  # method specs with options (``name:k=v``) are separated by ";"
                    value = (";" if any(":" in str(v) for v in value) else ",").join(map(str, value))
                setattr(args, key, value)
    return args


def spec_list(text: str):
    """A command line's list of model or method specs (``name:key=value,key=value``): separated by ";", or by
    "," where a comma-separated item with ``=`` and no ``:`` is one more option of the spec before it."""
    if ";" in text:
        return [item for item in text.split(";") if item]
    specs = []
    for item in filter(None, text.split(",")):
        if "=" in item and ":" not in item:
            if not specs:
                raise ValueError(f"{text!r}: option {item!r} comes before any method name (or model name)")
            specs[-1] += f",{item}"
        else:
            specs.append(item)
    return specs


def main(argv=None):
    args = parse(argv)
    models = spec_list(args.models)
    batches = [int(b) for b in args.batches.split(",")]
    method_specs = spec_list(args.methods)
    if args.single:
        path = Path(args.out)
        try:
            record = measure(models[0], batches[0], method_specs[0], args.image_size, args.steps, args.warmup,
                             args.device, args.amp, args.num_classes, args.fp_reference, not args.glibc_default)
        except torch.cuda.OutOfMemoryError as err:
            record = {"status": "oom", "error": str(err)[:500]}
        record.update(_identity(args, models[0], batches[0], method_specs[0]))
        results.write_json(path, record)
        return
    base_dir = Path(args.out or ROOT / "results" / "bench" / args.suite)
    if args.paired:
        return main_paired(args, models, batches, method_specs, base_dir)
    grid = [(k, model, batch, method) for k in range(1, args.rounds + 1) for model in models for batch in batches
            for method in method_specs]
    for k, model, batch, method in grid:
        out_dir = base_dir / f"r{k}" if args.rounds > 1 else base_dir
        path = out_path(out_dir, model, batch, method, args.amp)
        if path.exists() and not args.force:
            print(f"skip {results.relative_to_root(path)} (exists)")
            continue
        rec = run_one_subprocess(args, model, batch, method, path)
        tag = f"{'r' + str(k) + ' ' if args.rounds > 1 else ''}{model:16s} b{batch:<4d} {method:14s}"
        if rec["status"] == "ok":
            print(f"{tag} held {rec['act_mem_bytes'] / 2**20:9.1f} MiB  fp {rec['act_mem_fp_bytes'] / 2**20:9.1f} MiB  "
                  f"{rec['act_compression']:6.2f}x  peak {rec['peak_mem_bytes'] / 2**20:7.0f} MiB  "
                  f"{rec['throughput_img_s']:8.2f} img/s", flush=True)
        else:
            print(f"{tag} {rec['status']}", flush=True)


def main_paired(args, models, batches, method_specs, base_dir: Path):
    if args.threads:
        torch.set_num_threads(args.threads)
    for model in models:
        for batch in batches:
            path = base_dir / f"paired_{_safe(model)}_b{batch}{'' if args.amp == 'none' else '_' + args.amp}.json"
            if path.exists() and not args.force:
                print(f"skip {results.relative_to_root(path)} (exists)")
                continue
            rec = measure_paired(model, batch, method_specs, args.image_size, args.steps, args.warmup, args.device,
                                 args.amp, args.num_classes)
            rec.update({"model": model, "batch_size": batch, "image_size": args.image_size, "amp": args.amp,
                        "steps": args.steps, "warmup": args.warmup, "suite": args.suite,
                        "stem": _stem(model, args.image_size)})
            results.write_json(path, rec)
            for row in rec["methods"]:
                print(f"{model:16s} b{batch:<4d} {row['method']:14s} {row['throughput_img_s']:8.2f} img/s  "
                      f"{row['relative_to_first']:.3f} of {method_specs[0]} (quartiles {row['relative_q1']:.3f}-"
                      f"{row['relative_q3']:.3f}, {len(row['step_times_s'])} paired steps)", flush=True)


if __name__ == "__main__":
    main()
