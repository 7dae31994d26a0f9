"""GELU's derivative in a few bits (after Few-Bit Backward, Novikov et al., ICML 2023; Approx-BP, Liu et al.,
2024): instead of GELU's input, backward keeps which of 2**bits intervals each input fell in, and multiplies
the incoming gradient by that interval's constant. The intervals and constants are the least-squares
piecewise-constant fit of GELU' under a standard normal weight (GELU's inputs follow a batch or layer norm
here), found exactly by dynamic programming on a fine grid; see :func:`derivative_steps`.

Why: backward needs GELU' (x), not x. A 2-bit code of x itself (DIVISION's HFC) errs on GELU' by GELU'' times
the rounding error, which is a sizeable part of the map's range; a 2-bit code of the derivative errs only by
the fit, and is deterministic (no LFC, no per-map statistics: ``bits`` bits per element and nothing else).
"""
import functools
from dataclasses import dataclass
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from division.codecs.base import Packed
from division.codecs.packing import pack_bits, unpack_bits

GELU_BITS = (1, 2, 4)  # packable widths; 0 = off (GELU's input through the method's codec)
APPROXIMATIONS = ("none", "tanh")


def check_gelu_bits(bits) -> int:
    if isinstance(bits, bool) or bits not in (0,) + GELU_BITS:
        raise ValueError(f"gelu_bits={bits!r} is invalid; valid choices: {[0, *GELU_BITS]} (0: GELU's input "
                         "through the method's codec)")
    return bits


@functools.lru_cache(maxsize=None)
def derivative_steps(approximate: str, bits: int, grid: int = 2001, span: float = 8.0) -> Tuple[tuple, tuple]:
    """(boundaries, values): 2**bits - 1 increasing interval boundaries and 2**bits constants that minimise
    the integral of (GELU'(x) - step(x))^2 under a standard normal density, over steps constant between the
    boundaries. Exact for the grid (``grid`` points on [-span, span]; the outer intervals reach to infinity):
    dynamic programming over where each interval ends, with each interval's best constant its weighted mean."""
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r} is invalid; valid choices: {list(APPROXIMATIONS)}")
    with torch.enable_grad():  # first called inside a forward (an autograd function's, where grad is off)
        x = torch.linspace(-span, span, grid, dtype=torch.float64, requires_grad=True)
        d = torch.autograd.grad(F.gelu(x, approximate=approximate).sum(), x)[0]
    x = x.detach()
    w = torch.exp(-0.5 * x * x)
    zero = torch.zeros(1, dtype=torch.float64)
    s0, s1, s2 = (torch.cat([zero, torch.cumsum(v, 0)]) for v in (w, w * d, w * d * d))
    # cost[i, j]: squared error of one constant on grid points i .. j-1 (inf unless i < j)
    n0 = s0[None, :] - s0[:, None]
    n1 = s1[None, :] - s1[:, None]
    cost = torch.where(n0 > 0, (s2[None, :] - s2[:, None]) - n1 * n1 / n0.clamp_min(1e-300),
                       torch.full_like(n0, float("inf")))
    best = torch.full((grid + 1,), float("inf"), dtype=torch.float64)
    best[0] = 0.0
    starts = []
    for _ in range(2 ** bits):
        total = best[:, None] + cost  # [end of the earlier intervals, end of this one]
        best, start = total.min(0)
        starts.append(start)
    edges, end = [], grid
    for start in reversed(starts):  # walk back from the last interval
        edges.append(end)
        end = int(start[end])
    edges = [0] + edges[::-1]
    boundaries = tuple(float(0.5 * (x[e - 1] + x[e])) for e in edges[1:-1])
    values = tuple(float((s1[b] - s1[a]) / (s0[b] - s0[a])) for a, b in zip(edges[:-1], edges[1:]))
    return boundaries, values


@dataclass(eq=False)
class GeluDerivative(Packed):
    """Interval codes of GELU's input, ``bits`` per element packed, and a flag set where the input held NaN or
    Inf (decoded as NaN for the whole tensor, as the GPU codecs do: no host synchronisation to find them)."""

    packed: torch.Tensor
    bad: torch.Tensor  # 0-dim bool on the input's device
    values: torch.Tensor  # the 2**bits constants (float32, shared by every tensor of the codec on this device)
    bits: int
    shape: torch.Size
    kind = "gelu derivative"

    def tensors(self):
        return [self.packed, self.bad]  # the constants are the codec's, held once, not per activation

    def decode(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """GELU' as the steps give it, in ``dtype`` (NaN everywhere if the input was not finite)."""
        codes = unpack_bits(self.packed, self.bits, self.shape.numel()).to(torch.int32)
        slope = self.values.to(dtype)[codes].view(self.shape)
        return torch.where(self.bad, torch.full((), float("nan"), dtype=dtype, device=slope.device), slope)


class FewBitGelu:
    """Encodes GELU's input as the ``bits``-bit interval codes of :func:`derivative_steps`."""

    def __init__(self, bits: int):
        if check_gelu_bits(bits) == 0:
            raise ValueError("FewBitGelu needs bits > 0; valid choices: " + str(list(GELU_BITS)))
        self.bits = bits
        self._tables: Dict[tuple, tuple] = {}  # (approximate, device, dtype) -> (boundaries, values) tensors

    def _table(self, approximate: str, device, dtype):
        key = (approximate, str(device), dtype)
        if key not in self._tables:
            boundaries, values = derivative_steps(approximate, self.bits)
            self._tables[key] = (torch.tensor(boundaries, dtype=dtype, device=device),
                                 torch.tensor(values, dtype=torch.float32, device=device))
        return self._tables[key]

    def encode(self, x: torch.Tensor, approximate: str = "none") -> GeluDerivative:
        boundaries, values = self._table(approximate, x.device, x.dtype)
        codes = torch.bucketize(x.detach(), boundaries, out_int32=True).to(torch.uint8)
        bad = ~torch.isfinite(x.detach()).all()
        return GeluDerivative(pack_bits(codes, self.bits), bad, values, self.bits, x.shape)
