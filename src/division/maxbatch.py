"""Largest batch that trains one step within a memory budget: doubling, then bisection.

    python scripts/max_batch.py --model resnet50 --methods fp,division --budget 4GiB

Each probe is one benchmark subprocess (``division.bench.measure``, the runner's own training step). GPU:
the budget is compared with CUDA max allocated. CPU: with the peak resident-memory growth over the training
steps (model weights excluded; gradients and optimizer state, created by the steps, included), with glibc
told to return large blocks at free (``peak.release_freed_memory``).
"""
import argparse
import re
from pathlib import Path
from typing import Callable

from division import results

UNITS = {"": 1, "B": 1, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in UNITS:
        raise ValueError(f"budget={text!r} is invalid; use a number with a unit among {sorted(UNITS)[1:]}, e.g. 4GiB")
    return int(float(m.group(1)) * UNITS[m.group(2).upper()])


def find_max_batch(fits: Callable[[int], bool], start: int = 1, limit: int = 1 << 16) -> int:
    """Largest b in [0, limit] with fits(b), assuming fits is monotone (True up to some b*, then False)."""
    if fits(start):
        lo, hi = start, start * 2
        while hi <= limit and fits(hi):
            lo, hi = hi, hi * 2
        hi = min(hi, limit + 1)
    else:  # below the start: bisect [0, start)
        lo, hi = 0, start
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def parse(argv=None):
    from division.bench import ROOT
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--methods", default="fp,division")
    p.add_argument("--budget", default="4GiB")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"], help="autocast dtype of the probes")
    p.add_argument("--limit", type=int, default=4096)
    p.add_argument("--start", type=int, default=1, help="first batch tried (doubling from there)")
    p.add_argument("--out", default=str(ROOT / "results" / "max_batch"))
    p.add_argument("--glibc-default", action="store_true",
                   help="keep glibc's default malloc (its cached free memory then inflates the CPU peak)")
    return p.parse_args(argv)


def main(argv=None):
    from division.bench import parse as bench_parse, run_one_subprocess
    args = parse(argv)
    budget = parse_bytes(args.budget)
    out = Path(args.out)
    for method in args.methods.split(","):
        path = out / f"{args.model}_{method}_{args.budget}{'' if args.amp == 'none' else '_' + args.amp}.json"
        if path.exists():
            print(f"skip {path.name} (exists)")
            continue
        tried, prov = {}, {"device": None}
        bargs = bench_parse(["--image-size", str(args.image_size), "--steps", "1", "--warmup", "1",
                             "--device", args.device, "--amp", args.amp, "--suite", "max_batch",
                             "--no-fp-reference"] +
                            (["--glibc-default"] if args.glibc_default else []))

        def fits(batch: int) -> bool:
            tmp = out / ".probe" / f"{args.model}_{method}_b{batch}.json"
            tmp.unlink(missing_ok=True)
            rec = run_one_subprocess(bargs, args.model, batch, method, tmp)
            used = rec.get("peak_mem_growth_bytes") if rec["status"] == "ok" else None
            if rec.get("device"):
                prov.update({k: rec.get(k) for k in ("git_sha", "git_dirty", "code_version", "versions", "device")})
            tried[batch] = used
            print(f"  {method} batch {batch}: {'oom/error' if used is None else f'{used / 2**20:.0f} MiB'}", flush=True)
            return used is not None and used <= budget
        best = find_max_batch(fits, args.start, args.limit)
        results.write_json(path, {"status": "ok", "model": args.model, "method": method, "budget": args.budget,
                                  "amp": args.amp,
                                  "budget_bytes": budget, "max_batch": best, "probes": tried,
                                  "malloc_mmap_threshold": None if args.glibc_default else 65536,
                                  **prov})
        print(f"{args.model} {method}: max batch {best} within {args.budget}")



if __name__ == "__main__":
    main()
