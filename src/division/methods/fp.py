from division.methods.base import Method


class FullPrecision(Method):
    """Plain autograd: every activation a layer needs is kept as it is."""

    name = "fp"
    compilable = True
