"""Codec speed: DIVISION encode and decode on ResNet-50-shaped activations, compiled kernel vs the PyTorch
reference path. Prints elements per second; a measurement, not a test.

    python scripts/bench_codec.py --batch 8 --repeats 5
"""
import argparse
import statistics
import time

import torch

from division.codecs import DivisionCodec

SHAPES = [(256, 56, 56), (64, 112, 112), (1024, 14, 14), (2048, 7, 7)]  # channels, height, width


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(f"threads {torch.get_num_threads()}, batch {args.batch}, {args.bits}-bit HFC, block {args.block}; "
          "median of", args.repeats)
    print(f"{'shape':>16} {'backend':>9} {'encode ms':>10} {'Gelem/s':>8} {'decode ms':>10} {'Gelem/s':>8}")
    torch.manual_seed(0)
    for c, h, w in SHAPES:
        x = torch.randn(args.batch, c, h, w)
        for backend in ("compiled", "reference"):
            codec = DivisionCodec(args.block, args.bits, backend=backend)
            packed = codec.encode(x)
            enc = timed(lambda: codec.encode(x), args.repeats)
            dec = timed(packed.decode, args.repeats)
            print(f"{str((args.batch, c, h, w)):>16} {backend:>9} {enc * 1e3:10.1f} {x.numel() / enc / 1e9:8.2f} "
                  f"{dec * 1e3:10.1f} {x.numel() / dec / 1e9:8.2f}", flush=True)


if __name__ == "__main__":
    main()
