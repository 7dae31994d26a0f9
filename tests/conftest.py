import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = str(ROOT / "src" / "division" / "configs")
sys.path.insert(0, str(ROOT / "src"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
if not torch.cuda.is_available():
    # the Triton kernels run under Triton's interpreter on CPU tensors (set before they are first imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def compose(overrides=(), config_name="train"):
    from hydra import compose as hydra_compose, initialize_config_dir
    with initialize_config_dir(version_base="1.3", config_dir=CONFIG_DIR):
        return hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=False)


def run_train(overrides, tmp_path):
    """Compose and run one training job on CPU with no logging into ``tmp_path``."""
    from division.train import run
    cfg = compose(["trainer.device=cpu", "logger=none", "trainer.progress=false",
                   f"paths.root_dir={tmp_path}", *overrides])
    return run(cfg)


def import_script(name: str):
    """A module of scripts/, imported for its functions."""
    import importlib
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module(name)


def measured_step(method, model, x, y):
    """One cross-entropy step of a prepared model under the method's accounting, backward included:
    (bytes plain autograd would hold for it, the method's MemoryReport)."""
    import torch.nn.functional as F
    fp = method.fp_reference_bytes(model, lambda: F.cross_entropy(model(x), y))
    with method.accounting(model) as acc:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return fp, acc.report


@pytest.fixture
def real_data_dir():
    data_dir = os.environ.get("DATA_DIR")
    if not data_dir or not (Path(data_dir) / "cifar10_jpeg.tar.gz").exists():
        pytest.skip("DATA_DIR is unset or holds no cifar10_jpeg.tar.gz: set DATA_DIR=../shared/datasets "
                    "to run the real CIFAR-10 tests")
    return Path(data_dir)


@pytest.fixture(autouse=True)
def no_function_mode_left_active():
    """A test must not leave a TorchFunctionMode entered (the method's attention or residual modes): one left
    behind would change every later test's operations."""
    from torch.overrides import _get_current_function_mode_stack
    before = len(_get_current_function_mode_stack())
    yield
    left = _get_current_function_mode_stack()[before:]
    assert not left, f"function modes left active: {left}"
