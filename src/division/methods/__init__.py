"""Method registry: ``build(cfg)`` turns a ``configs/method/*.yaml`` node into a Method.

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


CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs" / "method"


def method_names():
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def load_config(spec: str) -> dict:
    """A method's options exactly as ``python train.py method=<name>`` composes them: ``configs/method/<name>.yaml``
    (with its defaults list), then ``key=value`` overrides: ``'division'`` or ``'division:hfc_bits=4,block_size=4'``."""
    from omegaconf import OmegaConf
    name, _, opts = spec.partition(":")
    if name not in method_names():
        raise ValueError(f"unknown method {name!r}; valid choices: {method_names()}")

    def compose(n):
        node = OmegaConf.load(CONFIG_DIR / f"{n}.yaml")
        parts = []
        for entry in node.pop("defaults", None) or []:
            parts.append(node if entry == "_self_" else compose(str(entry)))
        if not any(p is node for p in parts):
            parts.append(node)
        return OmegaConf.merge(*parts)
    cfg = compose(name)
    overrides = [item for item in re.split(r",(?![^\[]*\])", opts) if item]
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ValueError(f"method option(s) {bad} are not key=value (in {spec!r})")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


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
