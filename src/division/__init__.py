"""division: memory-efficient training by activation compression (DIVISION and its peers).

``division.prepare(model, method="division", **options)`` installs a method on any model; see
``division.api``."""
__version__ = "0.1.0"


def __getattr__(name):  # the API on first use, so that ``import division.codecs`` stays light
    if name in ("prepare", "Handle"):
        from division import api
        return getattr(api, name)
    raise AttributeError(f"module 'division' has no attribute {name!r}")


__all__ = ["prepare", "Handle"]
