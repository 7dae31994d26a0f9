"""The method interface: every activation-compression method is a small object with a configuration,
``prepare(model)`` (install itself for training steps, never touching parameters, buffers or state_dict)
and an accounting context that yields the memory report of one training step."""
import contextlib
from typing import List, Optional

import torch
import torch.nn as nn

from division.memory import MemoryReport, SavedTensorRecorder, build_report


@contextlib.contextmanager
def frozen_batchnorm_stats(module: nn.Module):
    """A forward that is not a training step of its own (checkpoint recomputation, the full-precision
    reference) must not move batch-norm running statistics."""
    saved = []
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            saved.append((m, m.momentum, m.num_batches_tracked.clone()))
            m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, count in saved:
            m.momentum = momentum
            m.num_batches_tracked.copy_(count)


class Method:
    name = "base"

    def __init__(self, name: Optional[str] = None):
        if name is not None:
            self.name = name
        self.covered: List[str] = []
        self.notes: List[str] = []
        self._enabled = True

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool):
        self._enabled = value
        policy = getattr(self, "policy", None)
        if policy is not None:
            policy.enabled = value

    @contextlib.contextmanager
    def bypassed(self):
        """Plain autograd for the duration (the full-precision reference of a step report)."""
        previous = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = previous

    def prepare(self, model: nn.Module) -> nn.Module:
        """Install the method on ``model`` (in place) and return it."""
        return model

    def policy_records(self):
        return []

    def ids(self):
        return None

    def extra_held(self):
        """(storage id, nbytes, fp bytes) tuples a method holds outside autograd (checkpoint inputs)."""
        return []

    def host_bytes(self) -> int:
        return 0

    @contextlib.contextmanager
    def accounting(self):
        """Wrap one training forward: afterwards ``acc.report`` holds its MemoryReport."""
        acc = _Accounting()
        recorder = SavedTensorRecorder(self.ids())
        with recorder.record():
            yield acc
        acc.report = build_report(self.policy_records(), recorder, self.notes, self.host_bytes())

    def fp_reference_bytes(self, model: nn.Module, run_forward) -> int:
        """Bytes plain autograd holds for the same forward, measured (not derived): the method is bypassed,
        batch-norm statistics are left as they were, and the graph is dropped at once."""
        recorder = SavedTensorRecorder()
        rng = torch.get_rng_state()
        with self.bypassed(), frozen_batchnorm_stats(model), recorder.record():
            out = run_forward()
        del out
        torch.set_rng_state(rng)
        return sum(nbytes for _, nbytes, _ in recorder.tensors.values())

    def describe(self) -> dict:
        return {"name": self.name, "covered_modules": len(self.covered)}


class _Accounting:
    report: Optional[MemoryReport] = None
