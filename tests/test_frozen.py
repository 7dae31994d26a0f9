"""Frozen layers: what no backward reads is not kept. A layer outside the autograd graph (a frozen stem fed the
batch) runs its own forward and keeps nothing; a convolution with a frozen weight keeps nothing of its input
(its input gradient needs the weight and the input's shape only), where plain autograd holds the whole input."""
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from division.methods import build, load_config
from division.models import create_model

# 8-bit codes with round-to-nearest: the codec is deterministic, so two runs that encode the same tensors give
# the same gradients bit for bit
SPEC = "division:hfc_bits=8,stochastic=false"


def _step(model, x, y):
    method = build(load_config(SPEC))
    method.prepare(model)
    model.train()
    with method.accounting(model) as acc:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return acc.report


def _twins(make):
    torch.manual_seed(0)
    a = make()
    b = make()
    b.load_state_dict(a.state_dict())
    return a, b


def test_a_frozen_stem_keeps_nothing_and_changes_no_other_gradient():
    frozen, trained = _twins(lambda: create_model("resnet20"))
    for name, p in frozen.named_parameters():
        if name.startswith(("conv1.", "bn1.")):
            p.requires_grad_(False)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    report_frozen, report_trained = _step(frozen, x, y), _step(trained, x, y)
    stem = {"conv1", "bn1", "relu"}  # the ReLU after a frozen stem: its input requires no gradient either
    rows = lambda report: Counter((r["layer"], r["codec"], tuple(r["shape"]), r["held_bytes"]) for r in report.layers)
    gone, added = rows(report_trained) - rows(report_frozen), rows(report_frozen) - rows(report_trained)
    assert not added
    assert {layer for layer, *_ in gone} == stem | {"(autograd)"}  # with bn1's saved statistics
    assert {layer for layer, *_ in rows(report_frozen)}.isdisjoint(stem)
    stem_bytes = sum(held * count for (*_, held), count in gone.items())
    assert stem_bytes > 0
    assert report_frozen.held_bytes == report_trained.held_bytes - stem_bytes
    for (name, p), q in zip(frozen.named_parameters(), trained.parameters()):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), name


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


@pytest.mark.parametrize("layer", ["3", "8"])
def test_a_frozen_weight_keeps_none_of_its_layers_input(layer):
    frozen, trained = _twins(_net)
    frozen.get_submodule(layer).weight.requires_grad_(False)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    report_frozen, report_trained = _step(frozen, x, y), _step(trained, x, y)
    row = [r for r in report_frozen.layers if r["layer"] == layer]
    assert [(r["codec"], r["held_bytes"]) for r in row] == [("none", 0)]
    held = [r["held_bytes"] for r in report_trained.layers if r["layer"] == layer]
    assert held[0] > 0 and report_frozen.held_bytes < report_trained.held_bytes
    for (name, p), q in zip(frozen.named_parameters(), trained.parameters()):
        if not p.requires_grad:
            assert p.grad is None
        elif name == f"{layer}.bias":  # summed by another kernel when the weight gradient is not made with it:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)  # float32 summation order only
        else:
            assert torch.equal(p.grad, q.grad), name
