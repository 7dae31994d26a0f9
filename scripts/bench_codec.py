"""Codec speed: DIVISION (and BLPA's per-layer quantizer) encode and decode on ResNet-50-shaped
activations, compiled kernel vs the pure-PyTorch reference path, each beside ``y.copy_(x)`` into a preallocated
tensor of the same shape (the memory-speed yardstick). Prints elements per second and the ratio to copy speed
and writes them with provenance to results/codec/codec_<device>.json; a measurement, not a test.

Like the training runner after its measured steps, it lets glibc reuse freed blocks under 32 MiB
(``peak.reuse_freed_memory``), so a decode's output comes from the heap instead of fresh pages;
``--glibc-default`` leaves the allocator as it starts.

``--relu-compact`` measures ``compact_relu`` instead (results/codec/compact_cpu.json): DIVISION on a ReLU
output, plain and with codes only for its positive elements (the ReLU's mask made beforehand, as the ReLU
makes it in training), each beside the same copy.

    python scripts/bench_codec.py --batch 8 --repeats 5
    python scripts/bench_codec.py --relu-compact

``--triton-sweep`` (a GPU, or Triton's interpreter) also times the HFC kernels alone (the LFC given) under
several ways of cutting them into programs (``triton_codecs.Launch``: elements per program, rows per program
at most, warps), so that a device run chooses the defaults by measurement.
"""
import argparse
import statistics
import time
from pathlib import Path

import torch

from division import peak, results
from division.codecs import BlpaCodec, DivisionCodec
from division.codecs.compact import compact_relu
from division.codecs.division import lfc_blocks
from division.codecs.exact import BitMask
from division.kernels import triton_codecs

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SHAPES = [(256, 56, 56), (64, 112, 112), (1024, 14, 14), (2048, 7, 7)]  # channels, height, width
# One row per program (the kernels before rows shared programs), the defaults, more warps, smaller programs.
LAUNCHES = [triton_codecs.Launch(4096, 1, 4), triton_codecs.Launch(4096, 64, 4), triton_codecs.Launch(4096, 64, 8),
            triton_codecs.Launch(1024, 64, 4)]


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, repeats: int, device: torch.device = torch.device("cpu")) -> float:
    """Median wall time of ``fn`` after one warm-up call, synchronised around each call on a GPU."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parse_shapes(text: str):
    try:
        shapes = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"--shapes {text!r}: expected positive CxHxW maps, comma-separated, "
                                         "e.g. 256x56x56,2048x7x7")
    return shapes


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="default: results/codec/codec_cpu.json (compact_cpu.json with "
                   "--relu-compact)")
    p.add_argument("--relu-compact", action="store_true", help="DIVISION with and without compact_relu on "
                   "ReLU outputs")
    p.add_argument("--shapes", type=parse_shapes, default=SHAPES,
                   help="maps as CxHxW, comma-separated (default: ResNet-50's " +
                   ",".join("x".join(map(str, s)) for s in SHAPES) + ")")
    p.add_argument("--glibc-default", action="store_true", help="do not change glibc's mmap threshold")
    p.add_argument("--device", default="cpu", help="cpu (compiled kernel vs reference) or cuda (Triton vs reference)")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="the activations' dtype (fp16 as under "
                   "fp16 autocast on a GPU)")
    p.add_argument("--triton-sweep", action="store_true", help="also time the Triton HFC kernels under each "
                   "launch in LAUNCHES (tile, rows per program, warps)")
    args = p.parse_args(argv)
    if torch.device(args.device).type not in ("cpu", "cuda"):
        p.error(f"--device {args.device!r} is invalid; valid choices: cpu, cuda")
    if args.triton_sweep and not triton_codecs.available(torch.device(args.device)):
        p.error(f"--triton-sweep needs Triton on --device {args.device!r} (a GPU, or TRITON_INTERPRET=1)")
    return args


def launch_sweep(x: torch.Tensor, bits: int, block: int, repeats: int, copy: float):
    """Rows timing the HFC kernels alone (the LFC made once, as the codec makes it) for each launch."""
    n, c, h, w = x.shape
    block_hw = lfc_blocks(h, w, block)
    lfc = DivisionCodec(block, bits, backend="triton")._lfc(x, block_hw)
    rows = []
    for launch in LAUNCHES:
        def encode():
            return triton_codecs.encode_rows(x.reshape(n * c, h * w), n * c, h * w, bits, True, lfc, (h, w),
                                             block_hw, launch=launch)
        packed, mn, scale, bad = encode()
        enc = timed(encode, repeats, x.device)
        dec = timed(lambda: triton_codecs.decode_rows(packed, mn, scale, bad, n * c, h * w, bits, lfc, (h, w),
                                                      block_hw, dtype=x.dtype, launch=launch), repeats, x.device)
        rows.append({"codec": "hfc", "shape": list(x.shape), "backend": "triton",
                     "launch": {"tile": launch.cap(), "max_rows": launch.rows_cap(), "num_warps": launch.num_warps},
                     "encode_ms": enc * 1e3, "decode_ms": dec * 1e3,
                     "encode_vs_copy": copy / enc, "decode_vs_copy": copy / dec})
        r = rows[-1]
        print(f"{'hfc':>8} {str(tuple(x.shape)):>18} tile {launch.cap():5d} rows<={launch.rows_cap():3d} "
              f"warps {launch.num_warps}: encode {r['encode_ms']:8.3f} ms decode {r['decode_ms']:8.3f} ms "
              f"enc/copy {r['encode_vs_copy']:6.3f} dec/copy {r['decode_vs_copy']:6.3f}", flush=True)
    return rows


def main(argv=None):
    args = parse(argv)
    device = torch.device(args.device)
    tag = "cpu" if device.type == "cpu" else "gpu_" + results.device_tag(device)
    out = args.out or str(results.ROOT / "results" / "codec" / (f"compact_{tag}.json" if args.relu_compact
                                                                 else f"codec_{tag}.json"))
    malloc = "glibc default" if args.glibc_default else ("heap reuse below 32 MiB" if peak.reuse_freed_memory()
                                                         else "glibc default (mallopt unavailable)")
    print(f"threads {torch.get_num_threads()}, batch {args.batch}, {args.bits}-bit HFC, block {args.block}; "
          "median of", args.repeats, "; malloc:", malloc)
    print(f"{'codec':>8} {'shape':>18} {'backend':>9} {'encode ms':>10} {'Gelem/s':>8} {'decode ms':>10} {'Gelem/s':>8} {'enc/copy':>8} {'dec/copy':>8}")
    torch.manual_seed(0)
    rows = []

    def division(backend):
        return DivisionCodec(args.block, args.bits, backend=backend)

    for c, h, w in args.shapes:
        x = torch.randn(args.batch, c, h, w, device=device).to(DTYPES[args.dtype])
        y = torch.empty_like(x)
        copy = timed(lambda: y.copy_(x), args.repeats, device)
        rows.append({"codec": "copy_", "shape": [args.batch, c, h, w], "backend": "torch",
                     "encode_ms": copy * 1e3, "encode_gelem_s": x.numel() / copy / 1e9})
        print(f"{'copy_':>8} {str((args.batch, c, h, w)):>18} {'torch':>9} {copy * 1e3:10.1f} "
              f"{x.numel() / copy / 1e9:8.2f}", flush=True)
        codecs = [("division", division, lambda c: c.encode)]
        if args.relu_compact:
            x = x.clamp_min_(0)
            mask = BitMask.positive(x)
            codecs.append(("div+cmp", division,
                           lambda c: lambda t: compact_relu(c.encode(t, mask), mask, c.backend)))
        else:
            codecs.append(("blpa", lambda b: BlpaCodec(4, backend=b), lambda c: c.encode))
        for name, make, encoder in codecs:
            if name == "blpa" and (c, h, w) != args.shapes[0]:
                continue
            for backend in ("compiled" if device.type == "cpu" else "triton", "reference"):
                encode = encoder(make(backend))
                packed = encode(x)
                enc = timed(lambda: encode(x), args.repeats, device)
                dec = timed(packed.decode, args.repeats, device)
                rows.append({"codec": name, "shape": [args.batch, c, h, w], "backend": packed.backend,
                             "encode_ms": enc * 1e3, "encode_gelem_s": x.numel() / enc / 1e9,
                             "decode_ms": dec * 1e3, "decode_gelem_s": x.numel() / dec / 1e9,
                             "encode_vs_copy": copy / enc, "decode_vs_copy": copy / dec})
                r = rows[-1]
                print(f"{name:>8} {str(tuple(r['shape'])):>18} {r['backend']:>9} {r['encode_ms']:10.1f} "
                      f"{r['encode_gelem_s']:8.2f} {r['decode_ms']:10.1f} {r['decode_gelem_s']:8.2f} "
                      f"{r['encode_vs_copy']:8.2f} {r['decode_vs_copy']:8.2f}", flush=True)
        if args.triton_sweep:
            rows.extend(launch_sweep(x, args.bits, args.block, args.repeats, copy))
    results.write_json(Path(out), {"status": "ok", "threads": torch.get_num_threads(), "bits": args.bits,
                                   "dtype": args.dtype, "batch": args.batch,
                                   "block": args.block, "repeats": args.repeats, "malloc": malloc,
                                   "relu_compact": args.relu_compact, "triton_sweep": args.triton_sweep,
                                   "rows": rows,
                                   **results.provenance(device)})
    print(f"wrote {results.relative_to_root(out)}")

if __name__ == "__main__":
    main()
