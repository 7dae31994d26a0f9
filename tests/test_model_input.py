"""The model's input: its share of the memory totals, reported on its own, and ``keep_input`` (held exactly,
by reference, instead of encoded)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from division.methods import build, load_config
from division.models import create_model


def _small_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def _report(spec, model, x, y):
    method = build(load_config(spec) if isinstance(spec, str) else spec)
    method.prepare(model)
    model.train()
    fp = method.fp_reference(model, lambda: F.cross_entropy(model(x), y))
    with method.accounting(model) as acc:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return acc.report.use_fp_reference(fp), method


@pytest.mark.parametrize("spec", ["fp", "division", "actnn", "division:keep_input=true"])
def test_input_share_is_reported_and_left_out_of_the_second_ratio(spec):
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    report, _ = _report(spec, _small_net(), x, y)
    assert report.input_fp_bytes == x.numel() * 4
    if spec == "fp" or spec.endswith("keep_input=true"):
        assert report.input_held_bytes == x.numel() * 4
    else:  # codes of the input: smaller than it, but there
        assert 0 < report.input_held_bytes < x.numel() * 4 / 4
    expected = (report.fp_bytes - report.input_fp_bytes) / (report.held_bytes - report.input_held_bytes)
    assert report.ratio_without_input == pytest.approx(expected)
    summary = report.summary()
    assert summary["act_mem_input_fp_bytes"] == x.numel() * 4
    assert summary["act_compression_without_input"] == pytest.approx(expected, rel=1e-4)


def test_without_a_model_nothing_is_taken_for_the_input():
    torch.manual_seed(0)
    model = _small_net()
    method = build({"name": "division"})
    method.prepare(model)
    with method.accounting() as acc:
        F.cross_entropy(model(torch.randn(2, 3, 16, 16)), torch.randint(0, 10, (2,))).backward()
    assert acc.report.input_fp_bytes == acc.report.input_held_bytes == 0
    assert acc.report.ratio_without_input == acc.report.ratio


def test_keep_input_holds_the_batch_itself_and_gives_the_first_layer_fps_gradient():
    """Only the first conv compressed: with keep_input its weight gradient is fp's exactly (the input is the
    caller's tensor, not a copy); without, 2-bit codes of the image make it differ."""
    torch.manual_seed(0)
    ref = _small_net()
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    F.cross_entropy(ref(x), y).backward()
    grads = {}
    for keep in (False, True):
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        method = build({"name": "division", "layers": ["conv"], "keep_input": keep})
        method.prepare(model)
        with method.accounting(model) as acc:
            F.cross_entropy(model(x), y).backward()
        grads[keep] = model[0].weight.grad
        first = next(r for r in method.policy.records if r.layer == "0")
        if keep:
            assert first.codec == "input" and first.held == [((x.device.type, x.device.index, x.data_ptr()),
                                                              x.numel() * 4)]
        else:
            assert first.codec == "division"
        assert acc.report.layers[0]["codec"] == first.codec
    assert torch.equal(grads[True], ref[0].weight.grad)
    assert not torch.allclose(grads[False], ref[0].weight.grad, rtol=1e-3, atol=1e-5)


def test_keep_input_leaves_every_other_tensor_to_the_codec():
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    plain, _ = _report("division", create_model("resnet20"), x, y)
    torch.manual_seed(0)
    kept, method = _report("division:keep_input=true", create_model("resnet20"), x, y)
    assert [r.codec for r in method.policy.records].count("input") == 1
    assert kept.held_bytes - kept.input_held_bytes == plain.held_bytes - plain.input_held_bytes
    assert kept.fp_bytes == plain.fp_bytes


def test_keep_input_refuses_an_input_changed_in_place_after_forward():
    torch.manual_seed(0)
    model = _small_net()
    build({"name": "division", "keep_input": True}).prepare(model)
    x = torch.randn(2, 3, 16, 16)
    loss = F.cross_entropy(model(x), torch.randint(0, 10, (2,)))
    x.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place.*keep_input"):
        loss.backward()


@pytest.mark.parametrize("name", ["division", "actnn", "blpa", "mesa", "division_plus", "division_nolfc"])
def test_keep_input_is_an_option_of_every_compressing_method(name):
    assert build(load_config(name)).policy.keep_input is False
    assert build(load_config(f"{name}:keep_input=true")).policy.keep_input is True
    with pytest.raises(ValueError, match=r"keep_input='maybe' is invalid; valid choices: \[True, False\]"):
        build(load_config(f"{name}:keep_input=maybe"))


@pytest.mark.parametrize("method", ["fp", "division"])
def test_the_library_handle_reports_the_input_share_too(method):
    """division.prepare accounts from inside the model's call (a forward pre-hook), where a hook added then
    would not run: the input is handed to the accounting directly."""
    import division
    torch.manual_seed(0)
    model = _small_net()
    handle = division.prepare(model, method=method)
    x = torch.randn(4, 3, 16, 16)
    F.cross_entropy(model(x), torch.randint(0, 10, (4,))).backward()
    report = handle.memory_report()
    assert report.input_fp_bytes == x.numel() * 4
    assert 0 < report.input_held_bytes <= x.numel() * 4
    assert (report.input_held_bytes == x.numel() * 4) == (method == "fp")
    handle.remove()
