"""WRPN: k-bit weights and activations in forward, exact packed codes for backward, widened models."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import import_script
from division import kernels
from division.codecs.quant import BitMask
from division.methods import build, load_config
from division.methods.wrpn import quantize_activation, quantized_relu
from division.models import create_model


class _SteReference(nn.Module):
    """The same quantized network with plain autograd (straight-through by detach), for comparison."""

    def __init__(self, model, bits):
        super().__init__()
        self.model, self.bits = model, bits
        convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        full = {id(convs[0]), id(linears[-1])}
        for m in model.modules():
            if isinstance(m, nn.ReLU):
                m.forward = self._act
            elif isinstance(m, (nn.Conv2d, nn.Linear)) and id(m) not in full:
                m.forward = self._layer(m)

    def _act(self, x):
        levels = (1 << self.bits) - 1
        y = x.clamp(0, 1)
        return y + (torch.round(y * levels) / levels - y).detach()

    def _layer(self, m):
        levels = (1 << (self.bits - 1)) - 1

        def forward(x):
            w = m.weight.clamp(-1, 1)
            w = w + (torch.round(w * levels) / levels - w).detach()
            if isinstance(m, nn.Conv2d):
                return F.conv2d(x, w, m.bias, m.stride, m.padding, m.dilation, m.groups)
            return F.linear(x, w, m.bias)
        return forward

    def forward(self, x):
        return self.model(x)


def test_wrpn_gradients_equal_a_plain_ste_network_and_codes_are_exact():
    torch.manual_seed(0)
    base = create_model("resnet20", width_mult=2)
    model, ref = copy.deepcopy(base), _SteReference(copy.deepcopy(base), 4)
    method = build(load_config("wrpn"))
    method.prepare(model)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    with method.accounting() as acc:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    for (n, p), q in zip(model.named_parameters(), ref.model.parameters()):
        scale = max(1.0, q.grad.abs().max().item())
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * scale, msg=n)
    codecs = acc.report.by_codec()
    assert codecs.get("quantized", 0) > 0  # the k-bit activations, packed


def test_wrpn_eval_is_quantized_and_training_reduces_loss():
    torch.manual_seed(0)
    model = create_model("resnet20")
    build({"name": "wrpn", "bits": 2}).prepare(model)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    model.eval()
    seen = {}
    model.layers[0][0].relu1.register_forward_hook(lambda m, i, o: seen.setdefault("out", o))
    with torch.no_grad():
        model(x)
    assert torch.unique(seen["out"]).numel() <= 4  # 2-bit activations in eval too


@pytest.mark.parametrize("bad, match", [({"name": "wrpn", "bits": 3}, "bits"), ({"name": "wrpn", "bits": 1}, "bits=1")])
def test_bad_wrpn_options(bad, match):
    with pytest.raises(ValueError, match=match):
        build(bad)


def test_width_mult_errors_name_the_choices():
    with pytest.raises(ValueError, match="models that have one"):
        create_model("resnet50", width_mult=2)
    with pytest.raises(ValueError, match="width_mult=0"):
        create_model("resnet20", width_mult=0)
    assert create_model("wrn28_10", width_mult=0.5).fc.in_features == 320


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [5, 16, 37, 4096 + 9])
def test_compiled_quantized_relu_matches_reference(n, bits):
    """The one-pass kernel gives the reference's k-bit values bit for bit (ties round half to even, NaN kept,
    infinities clamped) and the mask 0 < x < 1."""
    if not kernels.available():
        pytest.skip("no C compiler: the compiled kernels are optional")
    torch.manual_seed(0)
    levels = (1 << bits) - 1
    x = torch.rand(n) * 1.6 - 0.3
    ties = (torch.arange(n) % levels + 0.5) / levels  # exactly halfway between two levels, as fp32 gives it
    x[::3] = ties[::3]
    x[0], x[1], x[2], x[3], x[4] = float("nan"), -0.0, 1.0, float("inf"), float("-inf")
    y, mask = quantized_relu(x, bits, "compiled")
    expected = quantize_activation(x, bits)
    assert mask.backend == "compiled"
    assert torch.equal(y.isnan(), expected.isnan()) and torch.equal(y.nan_to_num(), expected.nan_to_num())
    assert torch.equal(mask.packed, BitMask.encode((x > 0) & (x < 1)).packed)
    ref_y, ref_mask = quantized_relu(x, bits, "reference")
    assert ref_mask.backend == "reference" and torch.equal(ref_y.nan_to_num(), expected.nan_to_num())


def test_weight_level_script_counts_zeros_after_the_first_convolution(capsys):
    """scripts/wrpn_weight_levels.py: the first convolution (full precision in WRPN) and 1x1 kernels are left
    out; 4 bits round |w| < 1/14 to 0."""
    wrpn_weight_levels = import_script("wrpn_weight_levels")
    state = {"stem.weight": torch.zeros(2, 3, 3, 3),
             "a.weight": torch.tensor([0.07, -0.07, 0.08, 1.5]).view(4, 1, 1, 1).expand(4, 1, 3, 3).clone(),
             "shortcut.weight": torch.zeros(4, 4, 1, 1), "bn.weight": torch.ones(4)}
    rows = wrpn_weight_levels.zero_shares(state, bits=4)
    assert [(name, share) for name, share, _ in rows] == [("a.weight", 0.5)]
    assert [name for name, _, _ in wrpn_weight_levels.zero_shares(state, 4, all_kernels=True)] == [
        "a.weight", "shortcut.weight"]
    wrpn_weight_levels.main(["--init", "resnet20", "--seed", "0"])
    assert "resnet20 at init, seed 0:" in capsys.readouterr().out
