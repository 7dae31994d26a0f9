"""Every registered model, built as the runner builds it from its default config (default dataset size, so
ImageNet CNNs get the CIFAR stem on 32x32; the ViT-S/16 keeps its 224 input) and trained with the default
method and optimizer (at the learning rate of the default batch), lowers the loss on a fixed small batch
within a few steps. Large models are marked slow (``make test-slow``)."""
import pytest
import torch
import torch.nn.functional as F

from conftest import compose
from division import api, engine, models

STEPS = 8
BATCH = 8
FAST = {"resnet20", "resnet18", "vit_cifar"}  # one of each family in the default run; the rest: make test-slow


def _cases():
    return [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in models.list_models()]


def _loss(model, x, y):
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


@pytest.mark.parametrize("name", _cases())
def test_default_recipe_lowers_the_loss(name):
    cfg = compose([f"model={name}", "trainer.device=cpu"])
    size = int(cfg.model.input_size) if name == "vit_small_patch16_224" else int(cfg.data.image_size)
    torch.manual_seed(0)
    model, _ = models.from_config(cfg.model, size)
    x = torch.randn(BATCH, 3, size, size)
    y = torch.arange(BATCH) % int(cfg.model.num_classes)
    method = api.prepare_config(model, cfg.method).method
    # the learning rate of the default batch size: the step size the default recipe takes after its warm-up
    optimizer, _ = engine.build_optimizer(model, cfg.optim, int(cfg.data.batch_size))
    state = engine.StepState(torch.device("cpu"), progress=False)
    before = _loss(model, x, y)
    for _ in range(STEPS):
        out = engine.train_step(model, method, x, y, optimizer, None, state)
        assert torch.isfinite(out.loss)
    after = _loss(model, x, y)
    assert after < 0.95 * before, (name, before, after)
