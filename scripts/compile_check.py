"""torch.compile with compressing methods, measured: graph breaks, held bytes compiled vs eager, and paired
throughput (eager fp, eager method, compiled fp, compiled method in one process, one timed step each per round
in alternating order; ratios taken per round, median and quartiles over rounds).

    python scripts/compile_check.py --model resnet20 --batch 128 --methods division,division_plus,actnn
    python scripts/compile_check.py --model resnet50 --batch 8 --image-size 224 --methods division
    python scripts/compile_check.py --model resnet50 --batch 256 --image-size 224 \
        --methods division,division:backend=reference --amp fp16 --device cuda --rounds 10
        # the GPU ratio (scripts/gpu_check.py --only compile): the codec through the Triton operators and
        # traced for Inductor (method.backend=reference), each against compiled fp

Writes results/compile/<device>_<model>_b<batch>.json (commit, dirty flag, device recorded).
"""
import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from division import api, bench, engine, results  # noqa: E402
from division.bench import spec_list as method_specs  # noqa: E402
from division.methods import build, load_config  # noqa: E402
from division.models import create_model  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet20")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--methods", default="division,division_plus,actnn",
                   help="method names, each optionally with options: division,division:backend=reference,"
                        "division:hfc_bits=8,stochastic=false")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", default="none", choices=list(engine.AMP_DTYPES),
                   help="autocast dtype (fp16 adds a gradient scaler, as the benchmarks do)")
    p.add_argument("--out", default=str(ROOT / "results" / "compile"))
    args = p.parse_args(argv)
    for spec in method_specs(args.methods):  # a bad name or option fails here, before any model is built
        try:
            build(load_config(spec))
        except ValueError as err:
            p.error(f"--methods: {err}")
    return args


def _kernel_maps(method) -> int:
    """Maps the compiled graphs encode through the kernel operators (compress/ops.py), not traced ops."""
    plans = getattr(method.saved_tensor_route, "plans", {})
    return sum(1 for p in plans.values() if p.action == "encode" and p.kernel)


def _variant(base, name, compiled, device):
    model = copy.deepcopy(base).to(device)
    method = build(load_config(name))
    method.prepare(model)
    if compiled:
        api.compile_model(model, method)
    return model, method, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def main(argv=None):
    args = parse(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    base = create_model(args.model)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=torch.Generator().manual_seed(1))
    x, y = x.to(device), (torch.arange(args.batch) % 10).to(device)
    state = bench.step_state(device, args.amp)
    names = ["fp"] + [m for m in method_specs(args.methods) if m != "fp"]
    variants, rows = {}, []
    for name in names:
        for compiled in (False, True):
            torch._dynamo.reset()
            model, method, opt = _variant(base, name, compiled, device)
            t0 = time.time()
            out = engine.train_step(model, method, x, y, opt, None, state, account=True)
            fp = engine.fp_reference(model, method, x, y, state)
            report = out.report.use_fp_reference(fp)
            rows.append({"method": name, "compiled": compiled, "graph_breaks": api.graph_breaks() if compiled else 0,
                         "first_step_s": round(time.time() - t0, 2), "held_bytes": report.held_bytes,
                         "fp_bytes": report.fp_bytes, "ratio": round(report.ratio, 4),
                         "kernel_maps": _kernel_maps(method) if compiled else 0})
            print(rows[-1], flush=True)
            variants[(name, compiled)] = (model, method, opt)
    for _ in range(args.warmup):
        for model, method, opt in variants.values():
            engine.train_step(model, method, x, y, opt, None, state)
    times = {key: [] for key in variants}
    for r in range(args.rounds):
        keys = list(variants) if r % 2 == 0 else list(reversed(variants))
        for key in keys:
            model, method, opt = variants[key]
            out = engine.train_step(model, method, x, y, opt, None, state)
            out.loss.item()
            times[key].append(out.timer.seconds)
    speed = {}
    for name in names:
        for compiled in (False, True):
            fp_t, m_t = times[("fp", compiled)], times[(name, compiled)]
            per_round = [f / m for f, m in zip(fp_t, m_t)]
            q = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else [per_round[0]] * 3
            speed[f"{name}{' compiled' if compiled else ''}"] = {
                "img_s": round(args.batch / statistics.median(m_t), 2), "relative_to_fp_same_mode": round(q[1], 4),
                "quartiles": [round(q[0], 4), round(q[2], 4)]}
    for key, value in speed.items():
        print(f"{key:28s} {value}")
    tag = results.device_tag(device)
    amp = "" if args.amp == "none" else f"_{args.amp}"
    path = Path(args.out) / f"{tag}_{args.model}_b{args.batch}{amp}.json"
    results.write_json(path, {"status": "ok", "model": args.model, "batch_size": args.batch,
                              "image_size": args.image_size, "amp": args.amp, "rounds": args.rounds, "memory": rows, "speed": speed,
                              "command": results.command_line("scripts/compile_check.py", argv or sys.argv[1:]),
                              **results.provenance(device)})
    print(f"wrote {results.relative_to_root(path)}")


if __name__ == "__main__":
    main()
