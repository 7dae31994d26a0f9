"""The fast CIFAR-10 recipe (experiment=cifar10_fast94): its network, data path, schedule, weight averaging and
test-time augmentation, and every method training it."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import compose, run_train
from division import engine
from division.data.arrays import TensorLoader
from division.methods import build, load_config, method_names
from division.models import create_model


def test_whitening_filters_decorrelate_patches():
    """After init_from_data the 2x2 convolution maps training patches to uncorrelated channels of variance
    l/(l+eps) for each eigenvalue l of the patch covariance (the float32 tolerance covers the products)."""
    torch.manual_seed(0)
    mix = torch.randn(3, 3)
    x = torch.einsum("ij,njhw->nihw", mix, torch.randn(64, 3, 16, 16))
    x = x + 0.5 * torch.roll(x, 1, dims=3)  # neighbouring pixels correlated
    model = create_model("fast94")
    eps = 5e-4
    model.init_from_data(x, eps=eps)
    y = F.conv2d(x, model.whiten.weight[:12])
    flat = y.transpose(0, 1).reshape(12, -1)
    cov = torch.cov(flat, correction=0)
    patches = x.unfold(2, 2, 1).unfold(3, 2, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, 12)
    lam = torch.linalg.eigvalsh(torch.cov(patches.t(), correction=0).double()).flip(0).float()
    assert torch.allclose(cov, torch.diag(lam / (lam + eps)), atol=2e-4), (cov.diag(), lam / (lam + eps))
    assert torch.equal(model.whiten.weight[12:], -model.whiten.weight[:12])


def test_frozen_batch_norm_weights_and_dirac_init():
    model = create_model("fast94")
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(not m.weight.requires_grad and m.bias.requires_grad for m in bns)
    conv = model.layers[0].conv1
    centre = conv.weight[:24, :, 1, 1]
    assert torch.equal(centre, torch.eye(24)) and not model.whiten.weight.requires_grad


def test_triangle_schedule():
    cfg = compose(["experiment=cifar10_fast94"]).optim
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = engine.build_scheduler(opt, cfg, steps_per_epoch=10, epochs=10)
    factors = []
    for _ in range(100):
        factors.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    factors.append(opt.param_groups[0]["lr"])
    assert factors[0] == pytest.approx(0.2) and factors[23] == pytest.approx(1.0) and factors[100] == pytest.approx(0.07)
    assert max(factors) == factors[23]


def test_bias_learning_rate_and_decay_scales():
    cfg = compose(["experiment=cifar10_fast94"]).optim
    model = create_model("fast94")
    opt, lr = engine.build_optimizer(model, cfg, global_batch=1024)
    weights, other, norms = opt.param_groups
    assert lr == pytest.approx(1.5) and weights["lr"] == pytest.approx(1.5) and norms["lr"] == pytest.approx(96.0)
    assert weights["lr"] * weights["weight_decay"] == pytest.approx(norms["lr"] * norms["weight_decay"])
    assert other["params"] == [model.whiten.bias] and other["lr"] == pytest.approx(1.5)  # as airbench: not x64
    bn_biases = {id(m.bias) for m in model.modules() if isinstance(m, nn.BatchNorm2d)}
    assert {id(p) for p in norms["params"]} == bn_biases
    assert opt.defaults["nesterov"] and opt.defaults["momentum"] == 0.85


def test_whitening_bias_trains_for_three_epochs():
    model = create_model("fast94")
    for epoch, trains in ((0, True), (2, True), (3, False), (9, False)):
        model.start_epoch(epoch)
        assert model.whiten.bias.requires_grad == trains


def test_lookahead_moves_the_model_to_its_average():
    model = nn.Linear(2, 1)
    look = engine.Lookahead(model, every=2, decay=0.5, total_steps=4)
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    look.step(1)  # not a multiple of 2: nothing happens
    assert torch.equal(model.weight, start + 1.0)
    look.step(2)
    keep = 0.5 ** 2 * (2 / 4) ** 3
    expected = start.lerp(start + 1.0, 1 - keep)
    assert torch.equal(model.weight, expected) and torch.equal(look.average["weight"], expected)
    with torch.no_grad():
        model.weight.add_(1.0)
    look.finish()
    assert torch.equal(model.weight, expected)
    again = engine.Lookahead(model, every=2, decay=0.5, total_steps=4)
    again.load_state_dict(look.state_dict())
    assert torch.equal(again.average["weight"], expected)
    with pytest.raises(ValueError, match="every"):
        engine.Lookahead(model, every=0, decay=0.5, total_steps=4)


def test_test_time_augmentation_levels():
    """A mirror-invariant model (global mean, then linear) gives the same logits with mirror TTA; level 2
    averages in two one-pixel shifts; evaluate records top-1 with and without it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 10))
    x = torch.randn(4, 3, 8, 8)
    # flip changes the order of the mean's additions only: float32 rounding
    assert torch.allclose(engine.tta_logits(model, x, 1), model(x), atol=1e-6)
    shifted = F.pad(x, (1, 1, 1, 1), mode="reflect")
    manual = 0.5 * model(x) + 0.25 * (model(shifted[..., :8, :8]) + model(shifted[..., 2:, 2:]))
    assert torch.allclose(engine.tta_logits(model, x, 2), manual, atol=1e-6)
    state = engine.StepState(torch.device("cpu"))
    out = engine.evaluate(model, [(x, torch.zeros(4, dtype=torch.long))], state, tta=2)
    assert {"top1", "top1_tta", "test_loss_tta"} <= set(out) and out["tta_level"] == 2
    with pytest.raises(ValueError, match="tta"):
        engine.evaluate(model, [], state, tta=3)


def test_reflect_padded_translation_keeps_image_content():
    """Reflect padding: a crop of a constant image is that constant everywhere; zero padding shows borders."""
    images = torch.full((8, 6, 6, 3), 200, dtype=torch.uint8).numpy()
    labels = torch.zeros(8, dtype=torch.long).numpy()
    for mode, has_zero in (("reflect", False), ("constant", True)):
        loader = TensorLoader(images, labels, 8, [0, 0, 0], [1 / 255] * 3, True, pad=2, flip=True, seed=1,
                              pad_mode=mode, device="cpu")
        (x, _), = list(loader)
        assert bool((x == 0).any()) == has_zero and x.max() == 200
    with pytest.raises(ValueError, match="pad_mode"):
        TensorLoader(images, labels, 8, [0] * 3, [1] * 3, True, pad_mode="wrap")



def test_whitening_sample_spans_the_classes_of_a_class_sorted_dataset():
    """Folder trees load class by class; the whitening sample must not be the first images (one class)."""
    labels = torch.arange(10).repeat_interleave(100).numpy()  # stored sorted by class, as read_tar_tree does
    images = torch.from_numpy(labels).to(torch.uint8).view(-1, 1, 1, 1).expand(-1, 4, 4, 3).contiguous().numpy()
    loader = TensorLoader(images, labels, 50, [0] * 3, [1 / 255] * 3, True, seed=3, device="cpu")
    sample = loader.sample_images(100)
    assert sample.shape == (100, 3, 4, 4) and len(sample[:, 0, 0, 0].unique()) == 10
    assert torch.equal(sample, loader.sample_images(100))  # the same sample for the same seed
    assert len(loader.sample_images(5000)) == 1000  # capped at the dataset's size

@pytest.mark.parametrize("name", [m for m in method_names() if m not in ("compile_budget", "swap", "wrpn")])
def test_every_method_trains_the_fast_network(name):
    """Every method runs a step of the fast network: GELU, maps of 31/15/7/3 pixels, the whitening
    convolution, frozen batch-norm weights (no gradient for them), finite gradients elsewhere."""
    torch.manual_seed(0)
    model = create_model("fast94")
    model.init_from_data(torch.randn(16, 3, 32, 32))
    method = build(load_config(name))
    method.prepare(model)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    F.cross_entropy(model(x), y, label_smoothing=0.2).backward()
    for p in model.parameters():
        assert (p.grad is None) == (not p.requires_grad)
        assert p.grad is None or torch.isfinite(p.grad).all()


def test_recipe_runs_and_records_tta(tmp_path):
    out = run_train(["experiment=cifar10_fast94", "data=synthetic", "data.train_size=64", "data.test_size=32",
                     "data.batch_size=32", "trainer.epochs=2", "method=division_plus",
                     "paths.runs_dir=" + str(tmp_path / "runs")], tmp_path)
    assert out["status"] == "ok" and out["top1_tta"] is not None and out["tta_level"] == 2
    assert out["epochs"][0].get("top1_tta") is None  # TTA at the last evaluation only
