"""How many of WRPN's quantized weights are 0: the share of each quantized convolution's weights that WRPN's
k-bit weight quantizer (clamp to [-1, 1], 2^(k-1) - 1 levels per sign) rounds to zero, in a training checkpoint
or at initialisation. The first convolution keeps full precision in WRPN and is left out, as are 1x1 shortcuts
unless --all-kernels.

    python scripts/wrpn_weight_levels.py results/runs/<exp>/<run id>/checkpoint.pt
    python scripts/wrpn_weight_levels.py --init resnet20 --width-mult 2 --seed 0
"""
import argparse

import torch

from division.methods.wrpn import full_precision_layers, quantize_weight
from division.models import create_model


def zero_shares(state_dict, bits: int, all_kernels: bool = False):
    """(name, zero share, weight std) of every convolution weight that WRPN quantizes, in order."""
    convs = [k for k, w in state_dict.items() if k.endswith("weight") and w.dim() == 4]
    full = set(full_precision_layers(convs, []))
    rows = []
    for name in convs:
        w = state_dict[name]
        if name not in full and (all_kernels or w.shape[-1] > 1):
            w = w.float()
            rows.append((name, (quantize_weight(w, bits) == 0).float().mean().item(), w.std().item()))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", help="a checkpoint.pt written by train.py")
    p.add_argument("--init", metavar="MODEL", help="measure a freshly initialised model instead")
    p.add_argument("--width-mult", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--all-kernels", action="store_true", help="include 1x1 convolutions")
    args = p.parse_args(argv)
    if bool(args.checkpoint) == bool(args.init):
        p.error("give a checkpoint or --init MODEL, not both or neither")
    if args.init:
        torch.manual_seed(args.seed)
        kwargs = {"width_mult": args.width_mult} if args.width_mult != 1 else {}
        state, label = create_model(args.init, **kwargs).state_dict(), f"{args.init} at init, seed {args.seed}"
    else:
        ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
        state, label = ckpt["model"], f"{args.checkpoint}, epoch {ckpt.get('epoch')}"
    rows = zero_shares(state, args.bits, args.all_kernels)
    if not rows:
        raise SystemExit("no quantized convolution weights found (a model with at most one convolution?)")
    total = sum(state[name].numel() for name, _, _ in rows)
    overall = sum(share * state[name].numel() for name, share, _ in rows) / total
    for name, share, std in rows:
        print(f"{name:40s} zero {share:.3f}  std {std:.4f}")
    print(f"{label}: {overall:.3f} of {total} quantized weights are 0 at {args.bits} bits")


if __name__ == "__main__":
    main()
