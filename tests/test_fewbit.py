"""GELU's derivative in a few bits (method option gelu_bits, codecs/fewbit.py)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from division import methods
from division.codecs.fewbit import derivative_steps


def _gelu_slope(x, approximate="none"):
    x = x.detach().double().requires_grad_()
    F.gelu(x, approximate=approximate).sum().backward()
    return x.grad


def _weighted_error(boundaries, values, approximate="none"):
    """Normal-weighted mean squared error of the steps against GELU', on a grid 10x finer than the fit's."""
    x = torch.linspace(-8, 8, 20001, dtype=torch.float64)
    steps = torch.tensor(values, dtype=torch.float64)[torch.bucketize(x, torch.tensor(boundaries, dtype=torch.float64))]
    w = torch.exp(-0.5 * x * x)
    return float((w * (steps - _gelu_slope(x, approximate)) ** 2).sum() / w.sum())


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_steps_are_the_least_squares_fit(approximate):
    """Each constant is its interval's normal-weighted mean of GELU' (the best constant there, to the fit's grid
    spacing of 0.008: hence 2e-3), the error falls with every bit, and from 2 bits on the fitted boundaries
    beat as many intervals cut at the normal's quantiles (what a fit that ignored GELU' would take; at 1 bit
    both cut at about 0)."""
    errors = []
    for bits in (1, 2, 4):
        boundaries, values = derivative_steps(approximate, bits)
        assert len(boundaries) == 2 ** bits - 1 and len(values) == 2 ** bits
        assert list(boundaries) == sorted(boundaries)
        x = torch.linspace(-8, 8, 20001, dtype=torch.float64)
        w, slope = torch.exp(-0.5 * x * x), _gelu_slope(x, approximate)
        edges = [-math.inf, *boundaries, math.inf]
        for lo, hi, value in zip(edges[:-1], edges[1:], values):
            inside = (x > lo) & (x <= hi)
            assert abs(float((w * slope)[inside].sum() / w[inside].sum()) - value) < 2e-3
        errors.append(_weighted_error(boundaries, values, approximate))
        if bits == 1:
            continue
        normal = torch.distributions.Normal(0.0, 1.0)
        quantiles = normal.icdf(torch.arange(1, 2 ** bits, dtype=torch.float64) / 2 ** bits).tolist()
        x_mid = [-8.0, *quantiles, 8.0]
        naive = []
        for lo, hi in zip(x_mid[:-1], x_mid[1:]):
            inside = (x >= lo) & (x <= hi)
            naive.append(float((w * slope)[inside].sum() / w[inside].sum()))
        assert errors[-1] < _weighted_error(quantiles, naive, approximate)
    assert errors[0] > errors[1] > errors[2]


def _gelu_method(bits):
    """DIVISION on GELU layers only, GELU's input through its codec (0) or its derivative in ``bits`` bits."""
    return methods.build({**methods.load_config("division"), "gelu_bits": bits, "layers": ["gelu"]})


def test_backward_is_the_incoming_gradient_times_the_step():
    """Deterministic: the input gradient equals grad * values[interval of x] exactly, and the layer holds the
    packed codes and a one-byte flag, nothing else. The steps are first fitted inside the forward (grad off
    there): nothing may have cached them before."""
    derivative_steps.cache_clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.GELU())
    method = _gelu_method(2)
    method.prepare(model)
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    grad = torch.randn(4, 8, 16, 16)
    with method.accounting(model, inputs=(x,)) as acc:
        y = model(x)
    y.backward(grad)
    boundaries, values = derivative_steps("none", 2)
    steps = torch.tensor(values)[torch.bucketize(x.detach(), torch.tensor(boundaries))]
    assert torch.equal(x.grad, grad * steps)
    assert torch.equal(y, F.gelu(x.detach()))
    gelu = [r for r in acc.report.layers if r["kind"] == "gelu"]
    assert len(gelu) == 1 and gelu[0]["codec"] == "gelu derivative"
    assert gelu[0]["held_bytes"] == x.numel() * 2 // 8 + 1


def test_a_nan_input_gives_nan_gradients():
    model = nn.Sequential(nn.GELU())
    _gelu_method(2).prepare(model)
    x = torch.randn(2, 3, 8, 8)
    x[1, 2, 3, 4] = float("nan")
    x.requires_grad_()
    model(x).sum().backward()
    assert torch.isnan(x.grad).all()


def test_fewer_bits_of_the_derivative_beat_the_codec_on_the_input():
    """At 2 bits per element, GELU's input gradient errs less from the fitted steps than from DIVISION's 2-bit
    HFC of its input (which also holds an LFC and per-map statistics): the reason for the option. Seeded, so
    the comparison is of two fixed numbers."""
    torch.manual_seed(0)
    x = (torch.randn(8, 16, 32, 32) + torch.randn(8, 16, 1, 1)).requires_grad_()
    grad = torch.randn_like(x)
    exact = torch.autograd.grad(F.gelu(x), x, grad)[0]
    errors = {}
    for bits in (0, 2):
        model = nn.Sequential(nn.GELU())
        _gelu_method(bits).prepare(model)
        got = torch.autograd.grad(model(x), x, grad)[0]
        errors[bits] = float((got - exact).norm() / exact.norm())
    assert errors[2] < 0.5 * errors[0], errors


def test_bad_gelu_bits_names_the_choices():
    with pytest.raises(ValueError, match=r"gelu_bits=3 is invalid; valid choices: \[0, 1, 2, 4\]"):
        methods.build(methods.load_config("division:gelu_bits=3"))
    with pytest.raises(ValueError, match="gelu_bits"):
        methods.build(methods.load_config("actnn:gelu_bits=true"))
