"""The method interface: every activation-compression method is a small object with a configuration,
``prepare(model)`` (install itself for training steps, never touching parameters, buffers or state_dict)
and an accounting context that yields the memory report of one training step."""
import contextlib
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn

from division.memory import MemoryReport, SavedTensorRecorder, build_report, model_inputs, parameter_storages


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
    saved_tensor_route = None  # a compiled model's saved-tensor hooks (compress.saved_hooks), set by compile_route

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

    def remove(self, model: nn.Module) -> nn.Module:
        """Undo ``prepare``: hooks removed, modules' own forwards back."""
        for h in getattr(self, "_handles", []):
            h.remove()
        self._handles = []
        for m in model.modules():
            m.__dict__.pop("forward", None)
        self.covered = []
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
    def accounting(self, model: Optional[nn.Module] = None, inputs=None):
        """Wrap one training forward: afterwards ``acc.report`` holds its MemoryReport. Pass the model so
        that saved tensors sharing storage with its parameters (``weight.t()``) are not counted, and so that
        the share of its input is reported on its own (``inputs``: the forward's arguments, for a caller
        already inside the model's call)."""
        acc = _Accounting()
        route = self.saved_tensor_route
        in_graph = getattr(route, "in_graph", False)  # the codec inside the compiled graphs (compress.graph_hooks)
        exclude = parameter_storages(model)
        recorder = acc.recorder = SavedTensorRecorder(route.ids if route is not None and not in_graph else self.ids(),
                                                      exclude=exclude)
        with model_inputs(model, inputs) as inputs, recorder.record():
            if route is not None:  # its hooks sit inside the recorder's: it hands on what it leaves alone
                setattr(route, "eager_saved" if in_graph else "passthrough", recorder._pack)
            try:
                yield acc
            finally:
                if route is not None:
                    setattr(route, "eager_saved" if in_graph else "passthrough", None)
        if in_graph:
            if acc.output is None:
                raise ValueError("accounting a compiled model needs the forward's result: set acc.output = loss "
                                 "inside the accounting block (engine.train_step does)")
            records = route.records(acc.output, recorder.ids, exclude, list(model.parameters()) if model else [],
                                    recorder.weight_casts)
        else:
            records = route.records if route is not None else self.policy_records()
        acc.report = build_report(records, recorder, self.notes, self.host_bytes(), inputs)

    def forward_context(self):
        """Entered around the model's call in a training step: a compiled model's saved-tensor hooks, if any."""
        route = self.saved_tensor_route
        return route.context() if route is not None and self.enabled else contextlib.nullcontext()

    def fp_reference(self, model: nn.Module, run_forward, inputs=None) -> "FpReference":
        """What plain autograd would hold for the same forward, measured without holding it: the method is
        bypassed, every saved tensor is recorded (size, storage) and dropped at once, so each activation is
        freed as soon as the forward no longer needs it. Batch-norm statistics and every random state the
        forward touches (CPU and the model's CUDA device) are left as they were."""
        recorder = SavedTensorRecorder(exclude=parameter_storages(model), keep=False)
        devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices), self.bypassed(), frozen_batchnorm_stats(model), \
                model_inputs(model, inputs) as inputs, recorder.record():
            out = run_forward()
        del out
        return FpReference(recorder.total_bytes(), sum(recorder.weight_casts.values()), recorder.bytes_of(inputs))

    def fp_reference_bytes(self, model: nn.Module, run_forward) -> int:
        return self.fp_reference(model, run_forward).act_bytes

    def describe(self) -> dict:
        out = {"name": self.name, "covered_modules": len(self.covered)}
        if getattr(self, "backend", None):
            out["backend"] = self.backend
        return out


class _Accounting:
    report: Optional[MemoryReport] = None
    recorder: Optional[SavedTensorRecorder] = None
    output: Optional[torch.Tensor] = None  # the forward's result: a compiled graph's saved tensors hang off it


@dataclass
class FpReference:
    act_bytes: int  # activations plain autograd saves (parameters and their views excluded)
    amp_weight_cast_bytes: int  # autocast copies of weights it also saves (not activations)
    input_bytes: int = 0  # of act_bytes: the model's input (saved by the first layer)
