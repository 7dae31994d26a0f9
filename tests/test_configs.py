import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import CONFIG_DIR, ROOT, compose
from division.models import create_model, list_models

GROUPS = ["data", "model", "method", "optim", "trainer", "logger"]


def _options(group):
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes(group):
    for option in _options(group):
        cfg = compose([f"{group}={option}"])
        OmegaConf.to_container(cfg, resolve=True)
        if group in ("data", "model", "method"):
            assert cfg[group].name == option, f"{group}/{option}.yaml must carry name: {option}"


def test_every_experiment_composes():
    for option in _options("experiment"):
        cfg = compose([f"experiment={option}"])
        OmegaConf.to_container(cfg, resolve=True)


def test_override_keys_exist():
    cfg = compose(["trainer.epochs=3", "trainer.max_steps=5", "data.batch_size=7", "data.subset=11",
                   "data.root=/tmp/x", "seed=4", "resume=true"])
    assert (cfg.trainer.epochs, cfg.trainer.max_steps, cfg.data.batch_size, cfg.data.subset, cfg.seed) == (3, 5, 7, 11, 4)
    assert cfg.data.root == "/tmp/x" and cfg.resume is True


def test_models_match_configs():
    assert set(_options("model")) == set(list_models())


@pytest.mark.parametrize("name", list_models())
def test_every_model_forward_backward(name):
    torch.manual_seed(0)
    imagenet = name in ("resnet50", "wide_resnet50_2", "densenet161", "vit_small_patch16_224")
    model = create_model(name, num_classes=10)
    size = 224 if imagenet else 32
    out = model(torch.randn(2, 3, size, size))
    assert out.shape == (2, 10)
    out.sum().backward()


def test_unknown_model_lists_choices():
    with pytest.raises(ValueError, match="valid choices"):
        create_model("nosuch")


@pytest.mark.parametrize("override,choice", [("model=nosuch", "resnet20"), ("method=nosuch", "division")])
def test_cli_unknown_choice_lists_options(override, choice):
    proc = subprocess.run([sys.executable, "train.py", override], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "Available options" in proc.stderr and choice in proc.stderr


def test_cli_help_lists_groups():
    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    for group in ("data:", "model:", "method:", "resnet50", "division"):
        assert group in proc.stdout


def test_models_choose_their_default_optimizer_and_sgd_lr():
    """A model config may name its optimizer (the ViTs: adamw) and SGD's lr (the ImageNet CNNs: 0.02, measured
    to train from scratch at CIFAR scale); an explicit optim choice or lr, and every experiment, still win."""
    assert compose(["model=resnet20"]).optim.lr == 0.1
    assert compose(["model=resnet50"]).optim.lr == 0.02
    assert compose(["model=resnet50", "optim.lr=0.1"]).optim.lr == 0.1
    assert compose(["model=wide_resnet50_2", "optim=adamw"]).optim.lr == 1e-3
    assert compose(["model=vit_cifar"]).optim.name == "adamw"
    assert compose(["model=vit_cifar", "optim=sgd"]).optim.name == "sgd"
    assert compose(["experiment=paper_imagenet_resnet50"]).optim.lr == 0.1


def test_library_method_loading_agrees_with_hydra():
    """``division.prepare`` reads method files without Hydra (PyYAML and a dict merge): for every method and
    an override, it gives what ``python train.py method=<name>`` composes."""
    from division.methods import load_config, method_names
    for name in method_names():
        assert load_config(name) == OmegaConf.to_container(compose([f"method={name}"]).method, resolve=True), name
    hydra_cfg = compose(["method=division_plus", "method.hfc_bits=4", "method.backend=reference"]).method
    assert load_config("division_plus:hfc_bits=4,backend=reference") == OmegaConf.to_container(hydra_cfg)


def test_method_spec_with_two_colons_names_the_separator():
    """``name:a=1:b=2`` once reached the method as ``a='1:b=2'`` and failed far away with a message about the
    value; options go after one ':' separated by ','."""
    from division.methods import load_config
    with pytest.raises(ValueError, match=r"separated by ','.*division_plus:budget=20x:budget_groups=false"):
        load_config("division_plus:budget=20x:budget_groups=false")
    cfg = load_config("division_plus:budget=20x,budget_groups=false")
    assert (cfg["budget"], cfg["budget_groups"]) == ("20x", False)
