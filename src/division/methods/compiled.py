"""``torch.compile`` with the min-cut partitioner's activation memory budget (PyTorch's own answer to
activation memory): with a budget below 1 the partitioner recomputes cheap ops in backward instead of saving
their outputs, until the saved activations fit the given fraction of what eager autograd would save.

Held bytes are measured as for every method: the compiled backward's saved tensors are saved by AOTAutograd's
autograd function, so the step's saved-tensor hooks see each of them (sizes and storages) like any other.
The budget is a global setting of ``torch._functorch.config``; it is set only around this model's compiled
calls (compilation happens in the first one), never left changed.
"""
import torch
import torch.nn as nn

from division.methods.base import Method


class CompileBudget(Method):
    name = "compile_budget"
    compiles_itself = True  # trainer.compile=true leaves it as it is

    def __init__(self, name=None, budget: float = 0.5, mode: str = "default"):
        super().__init__(name)
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
            raise ValueError(f"budget={budget!r} is invalid; it must be a number in (0, 1] (1 = save as eager does)")
        modes = ("default", "reduce-overhead", "max-autotune")
        if mode not in modes:
            raise ValueError(f"mode={mode!r} is invalid; valid choices: {list(modes)}")
        self.budget, self.mode = float(budget), mode

    def prepare(self, model: nn.Module) -> nn.Module:
        """Compiled in place as ``model.compile()`` does (parameters, buffers and state_dict keys unchanged); bypassed (the
        full-precision reference), the eager forward runs. Dynamo's caches are reset first: its guards do not
        cover the budget, so a graph compiled under another budget would otherwise be reused."""
        from division.api import compile_in_place
        torch._dynamo.reset()
        compile_in_place(model, mode=self.mode)  # model.compile(), also for an nn.Sequential under torch 2.11
        compiled, method = model._compiled_call_impl, self

        def call(*args, **kwargs):
            if not method.enabled:
                return model._call_impl(*args, **kwargs)
            with torch._functorch.config.patch(activation_memory_budget=method.budget):
                return compiled(*args, **kwargs)
        model._compiled_call_impl = call
        self.covered = [type(model).__name__]
        self.notes = [f"torch.compile (mode {self.mode}) with activation_memory_budget={self.budget}; held = the "
                      "tensors the compiled backward saves, seen by the saved-tensor hooks"]
        return model

    def remove(self, model: nn.Module) -> nn.Module:
        model._compiled_call_impl = None
        self.covered = []
        return model

    def describe(self) -> dict:
        return {**super().describe(), "budget": self.budget, "mode": self.mode}
