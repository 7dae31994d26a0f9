"""A byte budget for activations: each layer's precision chosen so that what one training step holds fits the
budget with the least estimated gradient error (``method.budget=20x`` or ``method.budget=40MiB``).

How it works (the DIVISION-family methods, ``methods/compressed.py``):

1. **Observe** one training step (``Division.calibrate`` before training, then every ``budget_refresh`` steps
   during it): for every 4-D activation a layer saves (a *site*), each candidate setting is encoded once
   (HFC bits 1/2/4/8 x LFC blocks 8/16, ActNN-style groups of 64/256/1024 at the same bits, a bf16 copy, or the
   activation itself, held exactly) for its exact held bytes, and decoded for its mean squared error. A ReLU
   output's codes are compacted to its positive elements (``compact_relu``: fewer bytes, the same error, so
   always the better choice under a budget); the step's backward gives each layer's
   output-gradient norm and weight-gradient norm.
2. **Estimate** each candidate's relative weight-gradient error. By default it is measured
   (``probe_sensitivities``, as GACT does): with the method bypassed, one full-precision forward, then one
   backward per site in which that site alone holds a 2-bit encoding; the squared relative change of every
   convolution's and linear layer's weight gradient, per unit of that encoding's mean squared error, is the
   site's sensitivity, and a candidate's error is its measured mean squared error times it (independent
   rounding noise adds linearly in variance). A batch norm whose output a fused convolution rebuilds
   (``fuse_bn_relu``) perturbs that convolution's input too. With ``budget_probe=false``, or for a site
   the probe does not find, an estimate from the observed step's norms: for a convolution or linear layer
   ``var * |g_out|^2 * fan_in / |dW|^2``; for sites without weights ``var / mean(x^2)`` once for every
   weighted layer before the site. On ResNet-50 at 224 (initial weights, batch 10) the estimate from norms
   put 1-bit codes where they did most harm: at 17x its plan's error was 1.12, the measured one's 0.65.
3. **Allocate**: a multiple-choice knapsack, solved by a Lagrangian sweep (each site takes the setting of
   least ``error + lambda * bytes``; ``lambda`` bisected to the smallest that fits), then upgrades by least
   error per byte while bytes remain. What the plan does not choose (ReLU masks, pool indices, statistics,
   bf16 2-D tensors) is held as measured, and counts against the budget.

The estimate costs one observed step (each candidate encoded and decoded once per site) and the probe (a
forward and one backward per site, holding that step's full-precision activations), timed together in
``Plan.observe_seconds``; a refresh during training (``budget_refresh``) re-measures bytes and variances and
keeps the probe's sensitivities.
"""
import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

BITS = (1, 2, 4, 8)
BLOCKS = (8, 16)
# ActNN-style group sizes the budget may choose: ActNN's own 256; 64 buys a tighter range per group for half a
# bit of bf16 statistics per element, 1024 a cheaper one where a map's spread is even
GROUPS = (64, 256, 1024)
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


# A ReLU output's compacted codes cover its positive elements, a count that varies from batch to batch: the
# plan charges each compacted candidate the codes of this fraction of the map's elements more than it saw, so
# that another batch still fits (a margin: two random batches on ResNet-50 differed by 0.0001 %; real images, and
# training moving the weights, vary more)
COMPACT_HEADROOM = 0.02


@dataclass
class Option:
    name: str  # "2b/B8", "4b/B16", "2b/G256", "bf16", "exact"
    codec: object  # has encode(x, split=None)
    nbytes: int  # what the observed step held (the plan charges nbytes + headroom)
    variance: float  # mean squared rounding error per element (0 for exact copies)
    headroom: int = 0  # bytes the plan reserves beyond nbytes (compacted codes: COMPACT_HEADROOM)

    @property
    def charged(self) -> int:
        return self.nbytes + self.headroom


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
    sensitivities: Optional[List[float]] = None  # measured (probe_sensitivities): per weighted layer

    @property
    def sensitivity(self) -> Optional[float]:
        """Measured squared relative error, summed over weighted layers, per unit of variance."""
        return None if self.sensitivities is None else sum(self.sensitivities)

    def rel_error(self, option: Option) -> float:
        """Estimated relative weight-gradient error the option adds: with a measured ``sensitivity`` the
        option's variance times it. Without one, from the observed step's norms: a convolution's or linear layer's input
        enters its own weight gradient only. A site without weights (a batch norm's or GELU's input) enters
        the input gradient its backward passes down, so its relative error reaches the weight gradient of
        every weighted layer before it (``reach``); counting it once made the allocation starve such sites
        near the budget's edge (measured on fast94 at 21.6x: error 1.53 against 0.58 for division_plus)."""
        if option.variance == 0:
            return 0.0
        if self.sensitivity is not None:
            return option.variance * self.sensitivity
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
        return self.fixed_bytes + sum(self.sites[k].options[i].charged for k, i in self.choices.items())

    @property
    def headroom_bytes(self) -> int:
        return sum(self.sites[k].options[i].headroom for k, i in self.choices.items())

    def option(self, key: str) -> Optional[Option]:
        i = self.choices.get(key)
        return None if i is None else self.sites[key].options[i]

    def describe(self) -> dict:
        errors = layer_errors(self.sites, self.choices)
        rows = [{"layer": s.layer, "kind": s.kind, "shape": list(s.shape), "choice": s.options[i].name,
                 "bytes": s.options[i].nbytes, "est_rel_error": s.rel_error(s.options[i])}
                for key, i in self.choices.items() for s in [self.sites[key]]]
        return {"budget_bytes": self.budget_bytes, "planned_bytes": self.planned_bytes,
                "headroom_bytes": self.headroom_bytes, "fixed_bytes": self.fixed_bytes, "fp_bytes": self.fp_bytes,
                "observe_seconds": round(self.observe_seconds, 3),
                "est_rel_error_sum": sum(r["est_rel_error"] for r in rows),
                "est_mean_rel_error": (statistics.mean(math.sqrt(e) for e in errors) if errors else None),
                "layers": rows}


def site_key(layer: str, kind: str) -> str:
    return f"{layer}:{kind}"


def candidate_codecs(make_division, make_plain, single_block_lfc: bool, h: int, w: int, make_groups=None):
    """(name, codec) for every setting a 4-D site may take; maps one block covers use the plain quantizer
    where ``single_block_lfc`` is off (their LFC is the map mean, which the minimum absorbs). With
    ``make_groups(bits, group)``, ActNN-style groups too (``2b/G256``): a range per ``group`` contiguous
    elements follows a map's local spread, which a per-map range does not, so at equal bytes it can err less."""
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
        if make_groups is not None:
            out.extend((f"{bits}b/G{group}", make_groups(bits, group)) for group in GROUPS)
    out.append(("bf16", _Bf16()))
    out.append(("exact", _Exact()))
    return out


class _Exact:
    """The activation itself, by reference (as plain autograd holds it) as a candidate codec: no error."""

    def encode(self, x, split=None):
        from division.codecs.exact import ExactReference
        return ExactReference.encode(x)


class _Bf16:
    """A bf16 copy as a candidate codec."""

    def encode(self, x, split=None):
        from division.codecs import Bf16Copy
        return Bf16Copy.encode(x)


def measure_options(x: torch.Tensor, candidates, split=None, finish=None) -> List[Option]:
    """Each candidate encoded once (with the split mask the site's encode will get, then ``finish``, e.g. the
    compaction of a ReLU output's codes, as the site's save does): its held bytes exactly and the mean squared
    error of its decode."""
    from division.codecs.compact import ReluCompacted
    options = []
    for name, codec in candidates:
        packed = codec.encode(x, split)
        if finish is not None:
            packed = finish(packed)
        headroom = 0
        if isinstance(packed, ReluCompacted):
            q = getattr(packed.inner, packed.part)
            headroom = math.ceil(COMPACT_HEADROOM * q.rows * q.row_len * q.bits / 8)
        options.append(Option(name, codec, _own_nbytes(packed, split), _variance(packed, x), headroom))
    return options


def _own_nbytes(packed, split=None) -> int:
    """The bytes an encoding adds: its storages without the split mask, which the ReLU that made it holds
    anyway (and the plan counts once, with the ReLU's record, whichever option it chooses)."""
    from division.codecs.base import storage_key, unique_nbytes
    mask = None if split is None else storage_key(split.packed)
    return unique_nbytes(t for t in packed.tensors() if t is not None and storage_key(t) != mask)


def _variance(packed, x) -> float:
    """Mean squared error of one encode, measured (stochastic rounding's scale^2 f(1-f) per element is far
    from its average scale^2/6 where values crowd at a range's end, as a ReLU output's do at 1 bit)."""
    return _mse(packed.decode(), x)


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).pow(2).mean())


def probe_sensitivities(model: torch.nn.Module, run_forward, sites: Dict[str, "Site"],
                        fused: Dict[str, Optional[str]], residual: Optional[Dict[str, tuple]] = None
                        ) -> Dict[str, List[float]]:
    """Each site's measured sensitivities (GACT's approach, Liu et al. 2022, per tensor and per layer): the
    squared relative error of each weighted layer's weight gradient when that site alone is held with a
    reference encoding, divided by that encoding's mean squared error. One full-precision forward keeps its
    graph; one exact backward, then one backward per site in which that site's saved tensor (and, for a batch
    norm whose output a fused convolution rebuilds, that convolution's input, ``fused``: conv layer -> batch
    norm layer; for a residual rebuild, ``residual``: conv layer -> its sources as SavePolicy describes them,
    every input along the chain that the site reaches) is replaced by its decode. Run with the method bypassed; costs a forward and 1 + len(sites)
    backwards, and holds the full-precision activations of that step."""
    modules = dict(model.named_modules())
    weights = [m.weight for m in modules.values() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
               and isinstance(m.weight, torch.nn.Parameter) and m.weight.requires_grad]
    entries, state = {}, {"current": None, "active": None, "decoded": None}
    by_layer = {}
    for key, site in sites.items():
        if site.layer in modules:
            by_layer.setdefault(site.layer, []).append(key)
    bn_of = {conv: f"{bn}:bn" for conv, bn in fused.items() if bn is not None and f"{bn}:bn" in sites}
    residual = residual or {}
    nodes = {**{conv: ("bnrelu", key) for conv, key in bn_of.items()}, **residual}
    inputs = {}  # a rebuilt convolution's exact input (its ReLU's mask)

    def pre_hook(name):
        def hook(mod, args):
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            state["current"], state["alpha"] = (name, x), None
            if x is not None and isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
                var, mean = torch.var_mean(x.detach().float(), dim=(0, 2, 3), unbiased=False)
                alpha = torch.rsqrt(var + mod.eps)
                state["alpha"] = alpha * mod.weight.detach().float() if mod.weight is not None else alpha
        return hook

    def post_hook(mod, args, out):
        state["current"] = None

    def pack(t):
        name, x = state["current"] or (None, None)
        if x is None or t.data_ptr() != x.data_ptr() or t.shape != x.shape:
            return t
        for key in by_layer.get(name, ()):
            if key not in entries:
                option = _reference_option(sites[key])
                entries[key] = (t, option.codec.encode(t.detach()), state.get("alpha"))
                return ("site", key, t)
        if name in nodes:
            inputs[name] = t
            return ("rebuilt", name, t)
        return t

    def decoded(key):
        if state["decoded"] is None:
            x, packed, _ = entries[key]
            state["decoded"] = packed.decode().to(x.dtype)
        return state["decoded"]

    def active(key):
        return key == state["active"] and key in entries

    def bn_shift(key):  # a batch norm's output change: alpha * (decode - y)
        x, _, alpha = entries[key]
        return (decoded(key).float() - x.float()) * alpha.view(1, -1, 1, 1)

    def shortcut_shift(source):
        kind, ref = source
        if kind == "conv":  # another rebuilt convolution's input, itself rebuilt
            return node_shift(ref) if ref in nodes and ref in inputs else None
        if not active(ref):
            return None
        return bn_shift(ref) if kind == "bn" else decoded(ref).float() - entries[ref][0].float()

    def node_shift(conv):
        """The change of a rebuilt convolution's input when the active site holds its decode: the ReLU's mask
        times the change of what it rebuilds from (a chain through the shortcuts)."""
        node, t = nodes[conv], inputs[conv]
        parts = [bn_shift(node[1]) if active(node[1]) else None]
        if node[0] == "res":
            parts.append(shortcut_shift(node[2]))
        parts = [p for p in parts if p is not None]
        return None if not parts else (t > 0) * sum(parts)

    def unpack(obj):
        if not isinstance(obj, tuple):
            return obj
        role, key, t = obj
        if role == "site":
            return decoded(key) if key == state["active"] else t
        shift = node_shift(key)  # a rebuilt convolution's input
        return t if shift is None else (t.float() + shift).to(t.dtype)

    hooked = set(by_layer) | set(nodes)
    handles = [modules[n].register_forward_pre_hook(pre_hook(n)) for n in hooked]
    handles += [modules[n].register_forward_hook(post_hook) for n in hooked]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            _, loss = run_forward()
        exact = torch.autograd.grad(loss, weights, retain_graph=True, allow_unused=True)
        norms = [None if g is None else float(g.double().pow(2).sum()) for g in exact]
        out = {}
        for key in entries:
            state["active"], state["decoded"] = key, None
            grads = torch.autograd.grad(loss, weights, retain_graph=True, allow_unused=True)
            variance = _mse(decoded(key), entries[key][0])
            errors = [float((g - e).double().pow(2).sum()) / n if g is not None and e is not None and n else 0.0
                      for g, e, n in zip(grads, exact, norms)]
            out[key] = [e / variance if variance > 0 else 0.0 for e in errors]
        return out
    finally:
        for h in handles:
            h.remove()
        state.clear()
        entries.clear()


def _reference_option(site: "Site") -> Option:
    """The probe's encoding: 2 bits where offered (the paper's), else the lossy option of most variance."""
    lossy = [o for o in site.options if o.variance > 0 and o.name != "bf16"] or site.options
    return next((o for o in lossy if o.name.startswith("2b")), max(lossy, key=lambda o: o.variance))


def allocate(sites: Dict[str, Site], available: int) -> Dict[str, int]:
    """Option index per site minimising the summed estimated error with summed bytes <= ``available``;
    ValueError if even the cheapest options do not fit."""
    keys = list(sites)
    cheapest = {k: min(range(len(sites[k].options)), key=lambda i: sites[k].options[i].charged) for k in keys}
    if sum(sites[k].options[cheapest[k]].charged for k in keys) > available:
        raise _Infeasible()
    err = {k: [sites[k].rel_error(o) for o in sites[k].options] for k in keys}

    def pick(lam):
        return {k: min(range(len(sites[k].options)), key=lambda i: (err[k][i] + lam * sites[k].options[i].charged,
                                                                   sites[k].options[i].charged)) for k in keys}

    def total(choice):
        return sum(sites[k].options[i].charged for k, i in choice.items())

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


def layer_errors(sites: Dict[str, Site], choice: Dict[str, int]) -> List[float]:
    """Each weighted layer's predicted squared relative weight-gradient error under ``choice`` (measured
    sensitivities times the chosen options' variances, summed over sites: independent rounding adds)."""
    probed = [(s, choice[k]) for k, s in sites.items() if s.sensitivities is not None and k in choice]
    if not probed:
        return []
    return [sum(s.sensitivities[l] * s.options[i].variance for s, i in probed)
            for l in range(len(probed[0][0].sensitivities))]


def _upgrade(choice, sites, err, left: int):
    """Spend the bytes the sweep left: repeatedly the upgrade of least added bytes per error removed."""
    while True:
        best = None
        for k, i in choice.items():
            for j, o in enumerate(sites[k].options):
                extra = o.charged - sites[k].options[i].charged
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


def _restored(sites: Dict[str, Site], chosen: Dict[str, str]) -> Dict[str, int]:
    """Option indices for a saved plan's choices, which must name exactly this step's sites and options."""
    if set(chosen) != set(sites):
        raise ValueError(f"the checkpoint's budget plan names sites {sorted(set(chosen) ^ set(sites))[:4]} that this "
                         "model's step does not have, or lacks them: it was made for another model or batch; "
                         "delete the checkpoint or run with resume=false")
    names = {key: [o.name for o in site.options] for key, site in sites.items()}
    bad = [(k, v) for k, v in chosen.items() if v not in names[k]]
    if bad:
        raise ValueError(f"the checkpoint's budget plan chose {bad[0][1]!r} at {bad[0][0]}; valid choices there: "
                         f"{names[bad[0][0]]}: delete the checkpoint or run with resume=false")
    return {k: names[k].index(v) for k, v in chosen.items()}


def make_plan(observer: BudgetObserver, records, budget: tuple, fp_bytes: Optional[int],
              outside_bytes: int = 0, chosen: Optional[Dict[str, str]] = None) -> Plan:
    """The plan for ``budget`` from an observed step: its sites, and the policy's records of that step (what
    they held, by storage, gives the bytes outside the plan; ``outside_bytes``: what plain autograd saved
    beside the policy in that step). ``chosen`` (site key -> option name, a checkpoint's plan): those choices
    instead of a new allocation."""
    kind, value = budget
    if kind == "ratio" and not fp_bytes:
        raise ValueError("a ratio budget needs the full-precision equivalent: calibrate the method first")
    budget_bytes = int(fp_bytes / value) if kind == "ratio" else int(value)
    other = {}  # storages of what no site holds (a ReLU's mask among them, though a site's codes use it as split)
    for r in records:
        if site_key(r.layer, r.kind) not in observer.sites or r.shared:
            other.update(r.held)
    fixed = sum(other.values()) + outside_bytes
    if chosen is not None:
        return Plan(budget_bytes, fixed, _restored(observer.sites, chosen), dict(observer.sites), fp_bytes,
                    observer.seconds)
    try:
        choices = allocate(observer.sites, budget_bytes - fixed)
    except _Infeasible:
        least = fixed + sum(min(o.charged for o in s.options) for s in observer.sites.values())
        ratio = f", {fp_bytes / least:.1f}x" if fp_bytes else ""
        raise ValueError(f"method.budget={budget_bytes} bytes ({budget_bytes / 2**20:.2f} MiB) is below what the "
                         f"cheapest choice needs; the least feasible budget is {least} bytes "
                         f"({least / 2**20:.2f} MiB{ratio}) for this model and batch") from None
    return Plan(budget_bytes, fixed, choices, dict(observer.sites), fp_bytes, observer.seconds)
