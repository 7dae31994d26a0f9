"""Method registry: ``build(cfg)`` turns a ``configs/method/*.yaml`` node into a Method.

Adding a method = one module with a Method subclass + one line here + one YAML file.
"""
from typing import Dict, Type

from division.methods.base import Method
from division.methods.compressed import ActNN, Blpa, Division, Mesa
from division.methods.fp import FullPrecision
from division.methods.recompute import Checkpoint, Swap

METHODS: Dict[str, Type[Method]] = {
    "fp": FullPrecision,
    "division": Division,
    "actnn": ActNN,
    "blpa": Blpa,
    "mesa": Mesa,
    "checkpoint": Checkpoint,
    "swap": Swap,
}


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


__all__ = ["Method", "METHODS", "build"]
