"""One model factory: ``create_model(name, num_classes=..., pretrained=...)``.

CIFAR models are the project's own; ImageNet CNNs come from torchvision, ViTs from timm. Pretrained weights
are downloaded by torchvision/timm when asked for (this needs network access)."""
import inspect
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


STEMS = ("auto", "cifar", "imagenet")
SMALL_INPUT = 64  # stem="auto": inputs up to this side get the CIFAR stem


def resolve_stem(stem: str, image_size=None) -> str:
    """``auto``: the CIFAR stem (3x3 stride-1 first convolution, no max-pool) for inputs of side <= 64, the
    ImageNet stem otherwise (and when the input size is unknown)."""
    if stem not in STEMS:
        raise ValueError(f"model.stem={stem!r} is invalid; valid choices: {list(STEMS)}")
    if stem == "auto":
        return "cifar" if image_size is not None and int(image_size) <= SMALL_INPUT else "imagenet"
    return stem


def create_model(name: str, num_classes: int = 10, pretrained: bool = False, stem: str = "imagenet",
                 image_size=None, **kwargs) -> nn.Module:
    """``stem``/``image_size`` matter for the ImageNet CNNs (see :func:`resolve_stem`) and the ImageNet ViT
    (its patch grid must fit the input); the CIFAR models have a CIFAR stem already."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid choices: {list_models()}")
    factory = _REGISTRY[name]
    if kwargs.get("width_mult", 1) == 1:
        kwargs.pop("width_mult", None)
    elif "width_mult" not in inspect.signature(factory).parameters:
        raise ValueError(f"model {name!r} has no width_mult; models that have one: "
                         f"{[n for n, f in _REGISTRY.items() if 'width_mult' in inspect.signature(f).parameters]}")
    else:
        check_width_mult(kwargs["width_mult"])
    chosen = resolve_stem(stem, image_size)  # validated for every model; used by those with an ImageNet stem
    if getattr(factory, "takes_input", False):
        kwargs.update(stem=chosen, image_size=image_size)
    return factory(num_classes=num_classes, pretrained=pretrained, **kwargs)


def stem_of(name: str, stem: str = "imagenet", image_size=None) -> str:
    """The stem ``create_model`` builds: what result files record."""
    if getattr(_REGISTRY.get(name), "takes_input", False):
        return resolve_stem(stem, image_size)
    return "cifar" if name in _CIFAR_NATIVE else "own"


def zero_init_residual_(model: nn.Module) -> int:
    """Zero the scale of the last batch norm in each post-activation residual block (Goyal et al., 2017), so
    every block starts as the identity: deep ResNets then train from scratch at lr 0.1 without tuning.
    Returns how many blocks were changed (0 for models without such blocks)."""
    from torchvision.models.resnet import BasicBlock as TvBasic, Bottleneck as TvBottleneck
    changed = 0
    for m in model.modules():
        bn = (m.bn3 if isinstance(m, TvBottleneck) else
              m.bn2 if isinstance(m, (TvBasic, cifar.BasicBlock)) else None)
        if bn is not None and bn.weight is not None:
            nn.init.zeros_(bn.weight)
            changed += 1
    return changed


def from_config(cfg, image_size=None):
    """The model a ``model`` config group describes, built as the runner builds it (stem chosen for
    ``image_size``, optional zero-initialised residual branches). Returns ``(model, zeroed_blocks)``."""
    model = create_model(cfg.name, num_classes=int(cfg.num_classes), pretrained=bool(cfg.get("pretrained", False)),
                         stem=str(cfg.get("stem", "auto")), image_size=image_size,
                         width_mult=cfg.get("width_mult", 1))
    zeroed = zero_init_residual_(model) if cfg.get("zero_init_residual", False) else 0
    return model, zeroed


def cifar_stem_(model: nn.Module) -> nn.Module:
    """Replace a torchvision ResNet's or DenseNet's 7x7 stride-2 stem and max-pool by a 3x3 stride-1
    convolution and nothing (as the paper's CIFAR ResNet-18 and common CIFAR practice do)."""
    holder, conv, pool = (model.features, "conv0", "pool0") if hasattr(model, "features") else (model, "conv1", "maxpool")
    old = getattr(holder, conv)
    setattr(holder, conv, nn.Conv2d(old.in_channels, old.out_channels, 3, 1, 1, bias=False))
    setattr(holder, pool, nn.Identity())
    return model


def _no_pretrained(name, pretrained):
    if pretrained:
        raise ValueError(f"model {name!r} has no pretrained weights; set model.pretrained=false")


@register("fast94")
def fast94(num_classes=10, pretrained=False, width_mult=1.0):
    """The fast CIFAR-10 network (airbench94-style, models/fast.py): whitening, three conv groups of widths
    64/256/256 (times ``width_mult``), frozen BN weights. Call ``init_from_data`` before training."""
    from division.models.fast import Fast94Net
    _no_pretrained("fast94", pretrained)
    return Fast94Net(num_classes, _widths((64, 256, 256), width_mult))


@register("resnet18")
def resnet18(num_classes=10, pretrained=False, width_mult=1.0):
    """The CIFAR ResNet-18 of the paper (3x3 stem, no max-pool, widths 64..512, times ``width_mult``)."""
    _no_pretrained("resnet18", pretrained)
    return cifar.CifarResNet((2, 2, 2, 2), _widths((64, 128, 256, 512), width_mult), num_classes)


def check_width_mult(mult) -> float:
    if isinstance(mult, bool) or not isinstance(mult, (int, float)) or mult <= 0:
        raise ValueError(f"width_mult={mult!r} is invalid; it must be a number > 0 (1 = as published)")
    return mult


def _widths(base, mult):
    """Channel widths scaled by ``mult`` (WRPN widens its networks; 1 = as published)."""
    return tuple(max(1, int(round(w * check_width_mult(mult)))) for w in base)


def _he_resnet(depth):
    def make(num_classes=10, pretrained=False, width_mult=1.0):
        _no_pretrained(f"resnet{depth}", pretrained)
        n = (depth - 2) // 6
        return cifar.CifarResNet((n, n, n), _widths((16, 32, 64), width_mult), num_classes, shortcut="pad")
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
def wrn28_10(num_classes=10, pretrained=False, dropout=0.0, width_mult=1.0):
    _no_pretrained("wrn28_10", pretrained)
    return cifar.WideResNet(28, 10 * check_width_mult(width_mult), dropout, num_classes)


def _torchvision(arch):
    def make(num_classes=1000, pretrained=False, stem="imagenet", image_size=None):
        import torchvision
        weights = "DEFAULT" if pretrained else None
        model = getattr(torchvision.models, arch)(weights=weights)
        if num_classes != 1000:
            head = "fc" if hasattr(model, "fc") else "classifier"
            setattr(model, head, nn.Linear(getattr(model, head).in_features, num_classes))
        if stem == "cifar":
            cifar_stem_(model)
        return model
    make.__doc__ = f"torchvision {arch} (ImageNet stem, or the CIFAR stem with stem='cifar')."
    make.takes_input = True
    return make


for _arch in ("resnet50", "wide_resnet50_2", "densenet161"):
    register(_arch)(_torchvision(_arch))


def vit_small_patch16_224(num_classes=1000, pretrained=False, stem="imagenet", image_size=None):
    """timm's ViT-S/16. Its 16x16 patches need inputs of at least 112 (a 7x7 grid), a multiple of 16."""
    import timm
    size = 224 if image_size is None else int(image_size)
    if size < 112 or size % 16:
        raise ValueError(f"vit_small_patch16_224 on {size}x{size} inputs would get a {size // 16}x{size // 16} patch "
                         f"grid; use model=vit_cifar (4x4 patches for 32x32) or data.image_size=224")
    return timm.create_model("vit_small_patch16_224", pretrained=pretrained, num_classes=num_classes,
                             **({} if size == 224 else {"img_size": size}))


vit_small_patch16_224.takes_input = True
register("vit_small_patch16_224")(vit_small_patch16_224)


@register("vit_cifar")
def vit_cifar(num_classes=10, pretrained=False):
    """A small ViT for 32x32 inputs: 4x4 patches (an 8x8 grid), width 192, depth 6, 3 heads."""
    _no_pretrained("vit_cifar", pretrained)
    from timm.models.vision_transformer import VisionTransformer
    return VisionTransformer(img_size=32, patch_size=4, num_classes=num_classes, embed_dim=192, depth=6,
                             num_heads=3, mlp_ratio=4.0)


_CIFAR_NATIVE = ("resnet18", "resnet20", "resnet32", "resnet56", "resnet164", "densenet121", "wrn28_10", "vit_cifar")

__all__ = ["create_model", "from_config", "list_models", "register", "resolve_stem", "stem_of", "cifar_stem_", "zero_init_residual_",
           "STEMS"]
