"""Measurements behind the paper's claim: how much activation energy sits in the LFC, how well each codec
rebuilds activations, and how far the weight gradients of a compressed step land from full precision."""
import copy
from typing import Callable, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

from division import CONFIG_DIR
from division.codecs import FullCopy
from division.codecs.division import block_average, lfc_blocks, upsample_blocks
from division.codecs.tokens import encode_tokens, token_body
from division.methods.compressed import PolicyMethod, token_grid


def lfc_energy_share(x: torch.Tensor, block: int) -> float:
    """||upsample(LFC)||^2 / ||x||^2 for a (N, C, H, W) map: 1 for a constant map, 0 for a zero-mean
    pattern inside every block."""
    n, c, h, w = x.shape
    bhw = lfc_blocks(h, w, block)
    up = upsample_blocks(block_average(x.float(), bhw), bhw, h, w)
    total = x.float().pow(2).sum()
    return float(up.pow(2).sum() / total) if total > 0 else 0.0


def relative_error(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    denom = x.float().norm()
    return float((x_hat.float() - x.float()).norm() / denom) if denom > 0 else float((x_hat.float()).norm())


class CodecMethod(PolicyMethod):
    """A policy method from any ``encode(x) -> Packed`` function: 4-D maps through it, token tensors of a ViT
    through it on their patch grid as DIVISION holds them (prefix tokens apart, here exact, so that only the
    codec under study differs from full precision); other tensors exact."""

    def __init__(self, encode: Callable, name: str = "custom", reuse_relu_mask: bool = False):
        self.encode = encode
        super().__init__(name, reuse_relu_mask=reuse_relu_mask)

    def choose(self, kind, x, split=None):
        if x.dim() == 4:
            return self.encode(x)
        if x.dim() == 3 and self.token_grid:
            return encode_tokens(self, x, *self.token_grid, keep_prefix=FullCopy)
        return FullCopy(x)


def analysed(module: nn.Module, inp: torch.Tensor) -> bool:
    """Whether the analysis follows this layer: every Conv2d, and every Linear fed tokens (B, T, C) (a ViT's:
    the layers whose inputs the methods compress)."""
    return isinstance(module, nn.Conv2d) or (isinstance(module, nn.Linear) and inp.dim() == 3)


def layer_inputs(model: nn.Module, x: torch.Tensor) -> Dict[str, torch.Tensor]:
    """What each analysed layer's codec sees, from one training-mode forward, keyed by module name: every
    Conv2d's input map and, in a ViT, every Linear's token input as maps on the patch grid (B, C, gh, gw;
    prefix tokens left out: the methods hold them apart in bf16)."""
    grid = token_grid(model)
    grabbed, handles = {}, []

    def grab(name):
        def hook(mod, args):
            a = args[0].detach()
            if analysed(mod, a) and (a.dim() == 4 or grid):
                grabbed.setdefault(name, (a if a.dim() == 4 else token_body(a, *grid)[0]).clone())
        return hook
    for name, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            handles.append(m.register_forward_pre_hook(grab(name)))
    model.train()
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return grabbed


class Approximation(FullCopy):
    """A float tensor standing in for the activation (LFC alone, HFC alone): unlike an exact full copy,
    ``reuse_relu_mask`` applies to it."""

    kind = "approximation"


def lfc_only(block: int):
    def encode(x):
        n, c, h, w = x.shape
        bhw = lfc_blocks(h, w, block)
        return Approximation(upsample_blocks(block_average(x.float(), bhw), bhw, h, w).to(x.dtype).contiguous())
    return encode


def hfc_only(block: int):
    def encode(x):
        n, c, h, w = x.shape
        bhw = lfc_blocks(h, w, block)
        return Approximation((x.float() - upsample_blocks(block_average(x.float(), bhw), bhw, h, w)).to(x.dtype))
    return encode


def weight_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, names=None) -> Dict[str, torch.Tensor]:
    """Weight gradients of one step keyed by parameter name: those of ``names``, or of the ``analysed`` layers."""
    found, handles = set(), []
    if names is None:
        names = found
        for n, m in model.named_modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                handles.append(m.register_forward_pre_hook(
                    lambda mod, args, n=n: found.add(f"{n}.weight") if analysed(mod, args[0]) else None))
    model.zero_grad(set_to_none=True)
    try:
        F.cross_entropy(model(x), y).backward()
    finally:
        for h in handles:
            h.remove()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if n in names and p.grad is not None}


def calibrate_on(method, model: nn.Module, batch) -> None:
    """A method with a byte budget plans its precision from one observed step on ``batch`` (x, y): in
    training the plan comes from an earlier batch, so the analyses give it another batch than the measured one."""
    if getattr(method, "budget", None) is None:
        return
    if batch is None:
        raise ValueError("a method with method.budget needs a calibration batch")
    x, y = batch

    def run():
        out = model(x)
        return out, F.cross_entropy(out, y)
    method.calibrate(model, run)


def gradient_error(model: nn.Module, method, x: torch.Tensor, y: torch.Tensor, draws: int = 3,
                   reference: Dict[str, torch.Tensor] = None, calibration=None) -> Dict[str, dict]:
    """Per analysed layer (see weight_grads): cosine and relative L2 error of the weight gradient against full
    precision, averaged over ``draws`` stochastic draws. The model is copied; batch norms use batch statistics
    as in training. ``calibration``: the batch a budgeted method plans from (see :func:`calibrate_on`)."""
    model = copy.deepcopy(model).train()
    if reference is None:
        reference = weight_grads(model, x, y)
    prepared = copy.deepcopy(model)
    method.prepare(prepared)
    calibrate_on(method, prepared, calibration)
    sums: Dict[str, List[float]] = {n: [0.0, 0.0] for n in reference}
    state = {k: v.clone() for k, v in prepared.state_dict().items()}
    for _ in range(draws):
        prepared.load_state_dict(state)  # running statistics must not drift between draws
        grads = weight_grads(prepared, x, y, names=set(reference))
        for n, g_ref in reference.items():
            g = grads[n]
            sums[n][0] += float(F.cosine_similarity(g.flatten().double(), g_ref.flatten().double(), dim=0))
            sums[n][1] += relative_error(g, g_ref)
    return {n: {"cosine": s[0] / draws, "rel_error": s[1] / draws} for n, s in sums.items()}


def held_compression(model: nn.Module, method, x: torch.Tensor, calibration=None) -> float:
    """Activation compression of ``method`` on one training forward of ``model`` over the batch ``x`` (held
    bytes against plain autograd's on the same batch): on trained weights and real data, where what some
    savings keep depends on the values (compact_relu: the ReLU outputs' zeros)."""
    prepared = copy.deepcopy(model).train()  # a copy: its batch-norm statistics may move
    method.prepare(prepared)
    calibrate_on(method, prepared, calibration)
    fp = method.fp_reference(prepared, lambda: prepared(x))
    with method.accounting(prepared) as acc:
        out = prepared(x)
    del out
    return acc.report.use_fp_reference(fp).ratio


def mean_over_layers(errors: Dict[str, dict], key: str) -> float:
    return sum(e[key] for e in errors.values()) / max(1, len(errors))


# two-sided 95 % quantiles of Student's t by degrees of freedom (beyond 30: the normal 1.96)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 25: 2.060, 30: 2.042}


def t975(dof: int) -> float:
    return T975.get(dof) or (T975[max(k for k in T975 if k <= dof)] if dof <= 30 else 1.96)


def mean_interval(values):
    """Mean and 95 % t interval (n-1 degrees of freedom) of independent values; interval None below two."""
    import math
    import statistics
    values = list(values)
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, None
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, (mean - half, mean + half)


def welch_interval(a, b):
    """mean(a) - mean(b) and its 95 % Welch interval (unequal variances; t at the Welch-Satterthwaite degrees
    of freedom, rounded down: conservative); interval None unless both have two or more values."""
    import math
    import statistics
    a, b = list(a), list(b)
    diff = statistics.mean(a) - statistics.mean(b)
    if len(a) < 2 or len(b) < 2:
        return diff, None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, (diff, diff)
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = t975(max(1, math.floor(dof))) * se
    return diff, (diff - half, diff + half)


def cifar10_data_config(data_root=None, synthetic_test_size: int = 0):
    """The data config of the analysis scripts, composed as the runner composes it: the real CIFAR-10 (from
    ``data_root`` or $DATA_DIR), or synthetic 32x32 data with ``synthetic_test_size`` test images."""
    from hydra import compose, initialize_config_dir
    overrides = ["data=cifar10"] + ([f"data.root={data_root}"] if data_root else [])
    if synthetic_test_size:
        overrides = ["data=synthetic", f"data.test_size={synthetic_test_size}", "data.image_size=32"]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        return compose(config_name="train", overrides=overrides).data


def balanced_batches(data_cfg, batches: int, per_class: int, seed: int = 0):
    """``batches`` disjoint test batches, each holding ``per_class`` images of every class, drawn at random
    (seeded) from the test split that ``data_cfg`` describes."""
    from division import data as data_lib
    cfg = copy.deepcopy(data_cfg)
    cfg.test_subset = batches * per_class
    _, test, _ = data_lib.build(cfg)
    xs, ys = zip(*test)
    x, y = torch.cat(list(xs)), torch.cat(list(ys))  # the test loader yields batches
    g = torch.Generator().manual_seed(seed)
    by_class = [c_idx[torch.randperm(len(c_idx), generator=g)] for c_idx in
                (torch.nonzero(y == c).squeeze(1) for c in torch.unique(y))]
    if min(len(c) for c in by_class) < batches * per_class:
        raise ValueError(f"the test split holds fewer than {batches * per_class} images of some class")
    out = []
    for b in range(batches):
        idx = torch.cat([c[b * per_class:(b + 1) * per_class] for c in by_class])
        out.append((x[idx], y[idx]))
    return out
