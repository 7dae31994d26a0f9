"""Method registry: ``build(cfg)`` turns a ``division/configs/method/*.yaml`` node into a Method.

Adding a method = one module with a Method subclass + one line here + one YAML file.
"""
import re
from pathlib import Path
from typing import Dict, Type

from division.methods.base import Method
from division.methods.compiled import CompileBudget
from division.methods.compressed import ActNN, Blpa, Division, Mesa
from division.methods.fp import FullPrecision
from division.methods.recompute import Checkpoint, SelectiveCheckpoint, Swap
from division.methods.wrpn import Wrpn

METHODS: Dict[str, Type[Method]] = {
    "fp": FullPrecision,
    "division": Division,
    "actnn": ActNN,
    "blpa": Blpa,
    "mesa": Mesa,
    "checkpoint": Checkpoint,
    "swap": Swap,
    "sac": SelectiveCheckpoint,
    "compile_budget": CompileBudget,
    "wrpn": Wrpn,
}


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "method"


def method_names():
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def load_config(spec: str) -> dict:
    """A method's options exactly as ``python train.py method=<name>`` composes them: ``division/configs/method/<name>.yaml``
    (with its defaults list), then ``key=value`` overrides: ``'division'`` or ``'division:hfc_bits=4,block_size=4'``.
    Method files are flat mappings, so PyYAML and a dict merge do what Hydra does for them: the library needs
    neither Hydra nor OmegaConf (a test checks both agree on every method)."""
    import yaml
    name, _, opts = spec.partition(":")
    if ":" in opts:
        raise ValueError(f"method options are separated by ',' after one ':' (name:key=value,key=value); got {spec!r}")
    if name not in method_names():
        raise ValueError(f"unknown method {name!r}; valid choices: {method_names()}")

    def compose(n) -> dict:
        node = yaml.safe_load((CONFIG_DIR / f"{n}.yaml").read_text()) or {}
        defaults = node.pop("defaults", None) or ["_self_"]
        merged = {}
        for entry in defaults if "_self_" in defaults else [*defaults, "_self_"]:
            merged.update(node if entry == "_self_" else compose(str(entry)))
        return merged
    cfg = compose(name)
    overrides = [item for item in re.split(r",(?![^\[]*\])", opts) if item]
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ValueError(f"method option(s) {bad} are not key=value (in {spec!r})")
    for item in overrides:
        key, _, value = item.partition("=")
        cfg[key.strip()] = yaml.safe_load(value) if value.strip() else None
    return cfg


def build(cfg) -> Method:
    """Build from a mapping with ``kind`` (the implementation) and ``name`` (what result files say)."""
    params = dict(cfg)
    kind = params.pop("kind", None) or params.get("name")
    if kind not in METHODS:
        raise ValueError(f"unknown method kind {kind!r}; valid choices: {sorted(METHODS)}")
    try:
        return METHODS[kind](**params)
    except TypeError as err:
        raise ValueError(f"bad options for method {kind!r}: {err}") from None


__all__ = ["Method", "METHODS", "build", "load_config", "method_names"]
