"""division: memory-efficient training by activation compression (DIVISION and its peers).

``division.prepare(model, method="division", **options)`` installs a method on any model; see
``division.api``."""
from pathlib import Path

__version__ = "0.1.0"
# the Hydra config tree (train.yaml and its groups), shipped inside the package
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def __getattr__(name):  # the API on first use, so that ``import division.codecs`` stays light
    if name in ("prepare", "Handle"):
        from division import api
        return getattr(api, name)
    raise AttributeError(f"module 'division' has no attribute {name!r}")


__all__ = ["prepare", "Handle", "CONFIG_DIR"]
