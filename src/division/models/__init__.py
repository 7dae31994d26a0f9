"""One model factory: ``create_model(name, num_classes=..., pretrained=...)``.

CIFAR models are the project's own; ImageNet CNNs come from torchvision, ViTs from timm. Pretrained weights
are downloaded by torchvision/timm when asked for (this needs network access)."""
from typing import Callable, Dict

import torch.nn as nn

from division.models import cifar

_REGISTRY: Dict[str, Callable[..., nn.Module]] = {}


def register(name: str):
    def wrap(fn):
        _REGISTRY[name] = fn
        return fn
    return wrap


def list_models():
    return sorted(_REGISTRY)


def create_model(name: str, num_classes: int = 10, pretrained: bool = False, **kwargs) -> nn.Module:
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid choices: {list_models()}")
    return _REGISTRY[name](num_classes=num_classes, pretrained=pretrained, **kwargs)


def _no_pretrained(name, pretrained):
    if pretrained:
        raise ValueError(f"model {name!r} has no pretrained weights; set model.pretrained=false")


@register("resnet18")
def resnet18(num_classes=10, pretrained=False):
    """The CIFAR ResNet-18 of the paper (3x3 stem, no max-pool, widths 64..512)."""
    _no_pretrained("resnet18", pretrained)
    return cifar.CifarResNet((2, 2, 2, 2), (64, 128, 256, 512), num_classes)


def _he_resnet(depth):
    def make(num_classes=10, pretrained=False):
        _no_pretrained(f"resnet{depth}", pretrained)
        n = (depth - 2) // 6
        return cifar.CifarResNet((n, n, n), (16, 32, 64), num_classes, shortcut="pad")
    make.__doc__ = f"He et al. (2016) CIFAR ResNet-{depth}: 3 stages of {(depth - 2) // 6} basic blocks, option-A shortcuts."
    return make


for _depth in (20, 32, 56):
    register(f"resnet{_depth}")(_he_resnet(_depth))


@register("resnet164")
def resnet164(num_classes=10, pretrained=False):
    _no_pretrained("resnet164", pretrained)
    return cifar.PreActResNet164(num_classes)


@register("densenet121")
def densenet121(num_classes=10, pretrained=False):
    _no_pretrained("densenet121", pretrained)
    return cifar.CifarDenseNet((6, 12, 24, 16), 32, num_classes=num_classes)


@register("wrn28_10")
def wrn28_10(num_classes=10, pretrained=False, dropout=0.0):
    _no_pretrained("wrn28_10", pretrained)
    return cifar.WideResNet(28, 10, dropout, num_classes)


def _torchvision(arch):
    def make(num_classes=1000, pretrained=False):
        import torchvision
        weights = "DEFAULT" if pretrained else None
        model = getattr(torchvision.models, arch)(weights=weights)
        if num_classes != 1000:
            head = "fc" if hasattr(model, "fc") else "classifier"
            setattr(model, head, nn.Linear(getattr(model, head).in_features, num_classes))
        return model
    make.__doc__ = f"torchvision {arch} (ImageNet stem)."
    return make


for _arch in ("resnet50", "wide_resnet50_2", "densenet161"):
    register(_arch)(_torchvision(_arch))


@register("vit_small_patch16_224")
def vit_small_patch16_224(num_classes=1000, pretrained=False):
    import timm
    return timm.create_model("vit_small_patch16_224", pretrained=pretrained, num_classes=num_classes)


@register("vit_cifar")
def vit_cifar(num_classes=10, pretrained=False):
    """A small ViT for 32x32 inputs: 4x4 patches (an 8x8 grid), width 192, depth 6, 3 heads."""
    _no_pretrained("vit_cifar", pretrained)
    from timm.models.vision_transformer import VisionTransformer
    return VisionTransformer(img_size=32, patch_size=4, num_classes=num_classes, embed_dim=192, depth=6,
                             num_heads=3, mlp_ratio=4.0)


__all__ = ["create_model", "list_models", "register"]
