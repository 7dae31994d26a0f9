"""The library API, through the README's own example (run as written, in a plain loop, on CPU)."""
import re

import pytest
import torch
import torch.nn.functional as F

import division
from conftest import ROOT, measured_step
from division.models import create_model


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    return re.search(r"<!-- api-example -->\s*```python\n(.*?)```", text, re.S).group(1)


def test_readme_example_runs_as_written(capsys):
    """The README's code exactly as written, its own loader included, prints what the model held."""
    torch.manual_seed(0)
    namespace = {}
    exec(compile(readme_example(), "README.md", "exec"), namespace)
    assert "MiB held" in capsys.readouterr().out and namespace["report"].ratio > 8


def test_readme_example_trains_and_reports(capsys):
    """The README's code with its loader replaced by one fixed batch given 20 times (so the loss must fall):
    it prints the held bytes, which equal an independent accounting of the same forward."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    losses = []
    loader = [(x, y)] * 20
    namespace = {"loader": loader}
    code = "\n".join(line for line in readme_example().splitlines() if not line.startswith("loader = "))
    code = code.replace("opt.step()", "opt.step(); losses.append(loss.item())")
    namespace["losses"] = losses
    exec(compile(code, "README.md", "exec"), namespace)
    assert losses[-1] < 0.5 * losses[0], losses
    report = namespace["report"]
    assert "MiB held" in capsys.readouterr().out
    model = namespace["model"]
    assert "forward" not in model.conv1.__dict__  # handle.remove() gave the modules their own forward back
    again = division.prepare(model, method="division", measure=False)
    with again.accounting() as acc:
        model(x)
    assert acc.report.held_bytes == report.held_bytes
    assert report.fp_bytes > 8 * report.held_bytes


def test_prepare_options_and_context_manager():
    model = create_model("resnet20")
    with division.prepare(model, method="actnn", bits=4) as handle:
        assert handle.method.codec.bits == 4 and handle.memory_report() is None
        F.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.randint(0, 10, (4,))).backward()
        first = handle.memory_report()
        assert first is not None and first.ratio > 4
        model(torch.randn(4, 3, 32, 32))  # later forwards are not accounted unless asked
        assert handle.memory_report() is first
    assert "forward" not in model.conv1.__dict__
    with pytest.raises(ValueError, match="unknown option"):
        division.prepare(create_model("resnet20"), method="division", blocksize=4)
    with pytest.raises(ValueError, match="valid choices"):
        division.prepare(create_model("resnet20"), method="divison")


def test_prepare_under_autocast_and_timm():
    torch.manual_seed(0)
    model = create_model("vit_cifar")
    handle = division.prepare(model, method="division")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.randint(0, 10, (2,)))
    loss.backward()
    report = handle.memory_report()
    assert report.ratio > 2  # bf16 activations halve the baseline; the weights' bf16 copies are apart
    assert report.amp_weight_cast_bytes > 0
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("spec", ["sac", "compile_budget:budget=0.1"])
def test_sac_and_compile_budget_keep_fp_gradients_and_hold_less(spec):
    """PyTorch-native baselines: selective checkpointing and torch.compile's memory budget change what is
    held, not the gradients (a small conv net: compiling takes seconds, not minutes)."""
    import copy
    import torch.nn as nn
    import torch.nn.functional as F
    from division.methods import build, load_config
    torch.manual_seed(0)

    def block(c):
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                             nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
    base = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Sequential(block(8), block(8)),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    ref = copy.deepcopy(base)
    F.cross_entropy(ref(x), y).backward()
    model = copy.deepcopy(base)
    method = build(load_config(spec))
    method.prepare(model)
    fp, report = measured_step(method, model, x, y)
    assert report.held_bytes < fp
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):  # compiled kernels sum in another order
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * max(1.0, q.grad.abs().max().item()))
    method.remove(model)


@pytest.mark.parametrize("policy_sees_output", [True, False])
def test_sac_records_each_kept_convolution_output(policy_sees_output, monkeypatch):
    """SAC keeps conv outputs outside autograd's saved tensors, so the method records them: from the policy's
    view of the output (torch >= 2.12), or from the cache as entries are added (torch 2.11, whose policy runs
    before the op; run this file under torch 2.11 to test that route). Both record exactly the bytes of the
    outputs of the convolutions inside the checkpointed blocks."""
    from division.methods import build, load_config, recompute
    if policy_sees_output != recompute._POLICY_SEES_OUTPUT:
        pytest.skip(f"this torch takes the other route (policy sees the output: {recompute._POLICY_SEES_OUTPUT})")
    torch.manual_seed(0)
    model = create_model("resnet20")
    method = build(load_config("sac"))
    method.prepare(model)
    outputs = []  # of the forward pass only: the hooks are gone before backward recomputes the blocks
    hooks = [m.register_forward_hook(lambda m, i, out: outputs.append(out.numel() * out.element_size()))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Conv2d) and name.startswith("layer")]
    logits = model(torch.randn(2, 3, 32, 32))
    for h in hooks:
        h.remove()
    F.cross_entropy(logits, torch.randint(0, 10, (2,))).backward()
    assert len(outputs) == 18 and sorted(fp for _, fp in method._kept.values()) == sorted(outputs)
    method.remove(model)


def test_trainer_compile_refuses_methods_it_cannot_compile():
    from division import api
    from division.methods import build
    from division.models import create_model
    with pytest.raises(ValueError, match="method 'checkpoint'"):
        api.compile_model(create_model("resnet20"), build({"name": "checkpoint"}))
