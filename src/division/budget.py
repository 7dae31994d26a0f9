"""A byte budget for activations: each layer's precision chosen so that what one training step holds fits the
budget with the least estimated gradient error (``method.budget=20x`` or ``method.budget=40MiB``).

How it works (the DIVISION-family methods, ``methods/compressed.py``):

1. **Observe** one training step (``Division.calibrate`` before training, then every ``budget_refresh`` steps
   during it): for every 4-D activation a layer saves (a *site*), each candidate setting is encoded once
   (HFC bits 1/2/4/8 x LFC blocks 8/16, or a bf16 copy) for its exact held bytes and its stochastic-rounding
   variance (scale^2 / 6 per element, from the stored statistics); the step's backward gives each layer's
   output-gradient norm and weight-gradient norm.
2. **Estimate** each candidate's relative weight-gradient error: for a convolution or linear layer
   ``var * |g_out|^2 * fan_in / |dW|^2`` (independent rounding noise in the input adds that much to
   ``|dW - dW_exact|^2``, relative to ``|dW|^2``); for sites without weights (batch norm, GELU inputs) the
   relative activation error ``var / mean(x^2)``, once for every weighted layer before the site (its error
   flows down the input gradient to all of their weight gradients).
3. **Allocate**: a multiple-choice knapsack, solved by a Lagrangian sweep (each site takes the setting of
   least ``error + lambda * bytes``; ``lambda`` bisected to the smallest that fits), then upgrades by least
   error per byte while bytes remain. What the plan does not choose (ReLU masks, pool indices, statistics,
   bf16 2-D tensors) is held as measured, and counts against the budget.

The estimate costs one observed step: encodes of every candidate per site, timed in ``Plan.observe_seconds``.
"""
import math
import re
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

BITS = (1, 2, 4, 8)
BLOCKS = (8, 16)
UNITS = {"B": 1, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9}


def parse_budget(text) -> tuple:
    """``'20x'`` -> ('ratio', 20.0): the full-precision equivalent divided by 20; ``'40MiB'`` -> ('bytes', n)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m and unit == "X" and float(m.group(1)) >= 1:
        return "ratio", float(m.group(1))
    if m and unit in UNITS and float(m.group(1)) > 0:
        return "bytes", int(float(m.group(1)) * UNITS[unit])
    raise ValueError(f"method.budget={text!r} is invalid; use a compression ratio of at least 1 such as '20x', or "
                     f"bytes with a unit among {sorted(UNITS)} such as '40MiB'")


@dataclass
class Option:
    name: str  # "2b/B8", "4b/B16", "bf16"
    codec: object  # has encode(x, split=None)
    nbytes: int
    variance: float  # mean squared rounding error per element (0 for exact copies)


@dataclass
class Site:
    layer: str
    kind: str
    shape: tuple
    mean_square: float  # mean of x^2
    options: List[Option]
    grad_out: Optional[float] = None  # |g_out|^2 of the layer's output in the observed step
    grad_weight: Optional[float] = None  # |dW|^2 of its weight
    fan_in: int = 1  # elements of the input each weight-gradient entry sums over per output position
    reach: int = 1  # weight gradients this site's error reaches (see rel_error)

    def rel_error(self, option: Option) -> float:
        """Estimated relative weight-gradient error the option adds. A convolution's or linear layer's input
        enters its own weight gradient only. A site without weights (a batch norm's or GELU's input) enters
        the input gradient its backward passes down, so its relative error reaches the weight gradient of
        every weighted layer before it (``reach``); counting it once made the allocation starve such sites
        near the budget's edge (measured on fast94 at 21.6x: error 1.53 against 0.58 for division_plus)."""
        if option.variance == 0:
            return 0.0
        if self.grad_out and self.grad_weight:
            return option.variance * self.grad_out * self.fan_in / self.grad_weight
        return option.variance / max(self.mean_square, 1e-30) * self.reach


@dataclass
class Plan:
    budget_bytes: int
    fixed_bytes: int  # held outside the plan's choices (masks, indices, statistics, unplanned tensors)
    choices: Dict[str, int]  # site key -> option index
    sites: Dict[str, Site]
    fp_bytes: Optional[int] = None
    observe_seconds: float = 0.0

    @property
    def planned_bytes(self) -> int:
        return self.fixed_bytes + sum(self.sites[k].options[i].nbytes for k, i in self.choices.items())

    def option(self, key: str) -> Optional[Option]:
        i = self.choices.get(key)
        return None if i is None else self.sites[key].options[i]

    def describe(self) -> dict:
        rows = [{"layer": s.layer, "kind": s.kind, "shape": list(s.shape), "choice": s.options[i].name,
                 "bytes": s.options[i].nbytes, "est_rel_error": s.rel_error(s.options[i])}
                for key, i in self.choices.items() for s in [self.sites[key]]]
        return {"budget_bytes": self.budget_bytes, "planned_bytes": self.planned_bytes,
                "fixed_bytes": self.fixed_bytes, "fp_bytes": self.fp_bytes,
                "observe_seconds": round(self.observe_seconds, 3),
                "est_rel_error_sum": sum(r["est_rel_error"] for r in rows), "layers": rows}


def site_key(layer: str, kind: str) -> str:
    return f"{layer}:{kind}"


def candidate_codecs(make_division, make_plain, single_block_lfc: bool, h: int, w: int):
    """(name, codec) for every setting a 4-D site may take; maps one block covers use the plain quantizer
    where ``single_block_lfc`` is off (their LFC is the map mean, which the minimum absorbs)."""
    out = []
    for bits in BITS:
        for block in BLOCKS:
            one_block = h <= block and w <= block
            if one_block and not single_block_lfc:
                if block != BLOCKS[0]:
                    continue  # the same codec as the smaller block's
                out.append((f"{bits}b", make_plain(bits)))
            else:
                out.append((f"{bits}b/B{block}", make_division(bits, block)))
    out.append(("bf16", _Bf16()))
    return out


class _Bf16:
    """A bf16 copy as a candidate codec."""

    def encode(self, x, split=None):
        from division.codecs import Bf16Copy
        return Bf16Copy.encode(x)


def measure_options(x: torch.Tensor, candidates, split=None, finish=None) -> List[Option]:
    """Each candidate encoded once (with the split mask the site's encode will get, then ``finish``, e.g. the
    compaction of a ReLU output's codes, as the site's save does): its held bytes exactly, its rounding
    variance from the stored scales (stochastic rounding adds scale^2 f(1-f) per element, scale^2/6 on
    average); bf16: the measured error."""
    options = []
    for name, codec in candidates:
        packed = codec.encode(x, split)
        if finish is not None:
            packed = finish(packed)
        options.append(Option(name, codec, packed.nbytes(), _variance(packed, x)))
    return options


def _variance(packed, x) -> float:
    q = getattr(packed, "hfc", None) or getattr(packed, "q", None)
    if q is not None and getattr(q, "scale", None) is not None:
        scale = q.scale.float()
        if scale.numel() in (q.rows, 2 * q.rows):  # one range per row, or two (a split): mean over ranges
            return float(scale.pow(2).mean() / 6)
    if packed.kind == "bf16":
        return float((x.float() - x.to(torch.bfloat16).float()).pow(2).mean())
    return float((packed.decode().float() - x.float()).pow(2).mean())


def allocate(sites: Dict[str, Site], available: int) -> Dict[str, int]:
    """Option index per site minimising the summed estimated error with summed bytes <= ``available``;
    ValueError if even the cheapest options do not fit."""
    keys = list(sites)
    cheapest = {k: min(range(len(sites[k].options)), key=lambda i: sites[k].options[i].nbytes) for k in keys}
    if sum(sites[k].options[cheapest[k]].nbytes for k in keys) > available:
        raise _Infeasible()
    err = {k: [sites[k].rel_error(o) for o in sites[k].options] for k in keys}

    def pick(lam):
        return {k: min(range(len(sites[k].options)), key=lambda i: (err[k][i] + lam * sites[k].options[i].nbytes,
                                                                   sites[k].options[i].nbytes)) for k in keys}

    def total(choice):
        return sum(sites[k].options[i].nbytes for k, i in choice.items())

    lo, hi = 0.0, 1.0
    while total(pick(hi)) > available and hi < 1e30:
        hi *= 16
    choice = pick(hi)
    if total(choice) > available:
        choice = cheapest
    if total(pick(lo)) <= available:
        return pick(lo)
    for _ in range(100):  # smallest lambda whose choice fits
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 1e6
        if total(pick(mid)) <= available:
            hi, choice = mid, pick(mid)
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return _upgrade(choice, sites, err, available - total(choice))


def _upgrade(choice, sites, err, left: int):
    """Spend the bytes the sweep left: repeatedly the upgrade of least added bytes per error removed."""
    while True:
        best = None
        for k, i in choice.items():
            for j, o in enumerate(sites[k].options):
                extra = o.nbytes - sites[k].options[i].nbytes
                gain = err[k][i] - err[k][j]
                if 0 < extra <= left and gain > 0 and (best is None or gain / extra > best[0]):
                    best = (gain / extra, k, j, extra)
        if best is None:
            return choice
        _, k, j, extra = best
        choice[k], left = j, left - extra


class _Infeasible(ValueError):
    pass


class BudgetObserver:
    """Collects the sites of one observed training step and their gradients, then makes the plan."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.sites: Dict[str, Site] = {}
        self.handles = []
        self.seconds = 0.0
        self.forwards = 0  # training forwards begun while observing (the plan comes at the next one)
        self.weighted_sites = 0  # convolution and linear sites observed so far (forward order)

    def observe(self, layer: str, kind: str, x: torch.Tensor, candidates, split=None, finish=None):
        key = site_key(layer, kind)
        if key in self.sites:
            return
        start = time.perf_counter()
        with torch.no_grad():
            options = measure_options(x.detach(), candidates, split, finish)
            mean_square = float(x.detach().float().pow(2).mean())
        weighted = kind in ("conv", "linear")
        self.sites[key] = Site(layer, kind, tuple(x.shape), mean_square, options,
                               reach=1 if weighted else max(1, self.weighted_sites))
        self.weighted_sites += weighted
        self._watch(key, layer, kind, x)
        self.seconds += time.perf_counter() - start

    def _watch(self, key, layer, kind, x):
        """Gradient norms of the layer's output (through a forward hook's tensor hook) and of its weight."""
        try:
            module = self.model.get_submodule(layer)
        except AttributeError:
            return
        site = self.sites[key]
        weight = getattr(module, "weight", None)
        if kind in ("conv", "linear") and isinstance(weight, torch.nn.Parameter) and weight.requires_grad:
            site.fan_in = int(weight[0].numel())
            self.handles.append(weight.register_post_accumulate_grad_hook(
                lambda p, s=site: setattr(s, "grad_weight", float(p.grad.float().pow(2).sum()))))

        def on_output(mod, args, out, s=site):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: setattr(s, "grad_out", float(g.float().pow(2).sum())))
        self.handles.append(module.register_forward_hook(on_output))

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def make_plan(observer: BudgetObserver, records, budget: tuple, fp_bytes: Optional[int],
              outside_bytes: int = 0) -> Plan:
    """The plan for ``budget`` from an observed step: its sites, and the policy's records of that step (what
    they held, by storage, gives the bytes outside the plan; ``outside_bytes``: what plain autograd saved
    beside the policy in that step)."""
    kind, value = budget
    if kind == "ratio" and not fp_bytes:
        raise ValueError("a ratio budget needs the full-precision equivalent: calibrate the method first")
    budget_bytes = int(fp_bytes / value) if kind == "ratio" else int(value)
    site_storages, other = set(), {}
    for r in records:
        target = site_storages if site_key(r.layer, r.kind) in observer.sites and not r.shared else None
        for skey, nbytes in r.held:
            if target is not None:
                target.add(skey)
            else:
                other[skey] = nbytes
    fixed = sum(n for skey, n in other.items() if skey not in site_storages) + outside_bytes
    try:
        choices = allocate(observer.sites, budget_bytes - fixed)
    except _Infeasible:
        least = fixed + sum(min(o.nbytes for o in s.options) for s in observer.sites.values())
        ratio = f", {fp_bytes / least:.1f}x" if fp_bytes else ""
        raise ValueError(f"method.budget={budget_bytes} bytes ({budget_bytes / 2**20:.2f} MiB) is below what the "
                         f"cheapest choice needs; the least feasible budget is {least} bytes "
                         f"({least / 2**20:.2f} MiB{ratio}) for this model and batch") from None
    return Plan(budget_bytes, fixed, choices, dict(observer.sites), fp_bytes, observer.seconds)
