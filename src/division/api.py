"""The library API: activation compression in one's own training loop, no Hydra needed.

    import division
    handle = division.prepare(model, method="division", block_size=8, hfc_bits=2)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)   # the first training forward is accounted
        loss.backward(); opt.step(); opt.zero_grad()
    print(handle.memory_report().table(top=10))
    handle.remove()                            # or: with division.prepare(model) as handle: ...

``handle.compile()`` compiles the model for the method (as ``trainer.compile=true`` does) and keeps this working.

The runner (``division.train``) goes through the same call.
"""
import contextlib
from typing import Optional

import torch
import torch.nn as nn

from division import methods
from division.memory import MemoryReport


class Handle:
    """A method installed on a model. The next training forward after ``prepare`` (or ``measure_next()``)
    is accounted: ``memory_report()`` then returns what it held for backward, with the full-precision
    equivalent measured on the same inputs (the method bypassed, nothing kept alive)."""

    def __init__(self, model: nn.Module, method: methods.Method, config: dict):
        self.model, self.method, self.config = model, method, config
        self._report: Optional[MemoryReport] = None
        self._armed = False
        self._busy = False
        self._context = None
        self._hooks = []
        self._inner_call = None  # a compiled model's own compiled call, inside the handle's (see compile())
        self._call = None        # the handle's call around it
        if getattr(model, "_compiled_call_impl", None) is not None:  # a method that compiles itself
            self._wrap_compiled_call()

    def measure_next(self, fp_reference: bool = True) -> "Handle":
        """Account the next training forward of the model (and measure its full-precision equivalent)."""
        if not self._hooks and self._inner_call is None:
            self._hooks = [self.model.register_forward_pre_hook(self._begin, with_kwargs=True),
                           self.model.register_forward_hook(self._end)]
        self._armed, self._fp_reference = True, fp_reference
        return self

    def compile(self, **options) -> nn.Module:
        """Compile the model in place for this method, as ``trainer.compile=true`` does (fp and compile_budget
        as they are, a compressing method through its compile route), and keep the handle working: the
        method's saved-tensor hooks around each call, the accounting outside the compiled code. ``model.compile()``
        called directly would compile the handle's hooks into the graph and call none of the method's hooks.
        ``options``: ``torch.compile``'s (``mode``, ``dynamic``, ...). Returns the model."""
        compile_model(self.model, self.method, **options)
        self._wrap_compiled_call()
        return self.model

    def _wrap_compiled_call(self):
        """The compiled call runs inside the handle's: accounting (the full-precision reference included)
        before and after it, in eager code, and the method's forward context around it."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._call is not None and self.model._compiled_call_impl is self._call:
            return  # compile() again where the method compiled itself: the handle's call is already there
        inner = self._inner_call = self.model._compiled_call_impl

        def call(*args, **kwargs):
            self._begin(self.model, args, kwargs)
            with self.method.forward_context():
                out = inner(*args, **kwargs)
            self._end(self.model, args, out)
            return out
        self.model._compiled_call_impl = self._call = call

    def _begin(self, module, args, kwargs):
        if torch.compiler.is_compiling():  # the model was compiled after prepare(): see compile()
            return None
        if not (self._armed and not self._busy and module.training and self.method.enabled):
            return None
        if not torch.is_grad_enabled():
            return None
        self._busy = True
        try:
            fp = self.method.fp_reference(module, lambda: module(*args, **kwargs)) if self._fp_reference else None
        finally:
            self._busy = False
        self._fp = fp
        self._context = self.method.accounting(module, inputs=(*args, *kwargs.values()))
        self._accounting = self._context.__enter__()
        return None

    def _end(self, module, args, output):
        if self._context is None or self._busy or torch.compiler.is_compiling():
            return None
        if isinstance(output, torch.Tensor):
            self._accounting.output = output
        self._context.__exit__(None, None, None)
        self._context, self._armed = None, False
        report = self._accounting.report
        if self._fp is not None:
            report.use_fp_reference(self._fp)
        self._report = report
        return None

    def memory_report(self) -> Optional[MemoryReport]:
        """The report of the last accounted training forward (None before one ran). It counts what the
        model's forward holds; a loss computed outside the model adds a few bytes more."""
        return self._report

    @contextlib.contextmanager
    def accounting(self):
        """Account exactly the forward inside the block (loss included); ``acc.report`` afterwards."""
        with self.method.accounting(self.model) as acc:
            yield acc

    def remove(self) -> nn.Module:
        """Uninstall the method: the model's own forwards come back; parameters were never touched."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._inner_call is not None:  # the model stays compiled, without the handle's call around it
            self.model._compiled_call_impl, self._inner_call, self._call = self._inner_call, None, None
        self.method.remove(self.model)
        return self.model

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def __repr__(self):
        return f"Handle(method={self.method.name!r}, covered={len(self.method.covered)} modules)"


def prepare(model: nn.Module, method: str = "division", measure: bool = True, **options) -> Handle:
    """Install ``method`` (a name from ``division/configs/method/``, with that file's defaults) on ``model`` in place.
    ``options`` override the defaults (``block_size=4``, ``hfc_bits=4``, ``backend="reference"``...); a bad
    name or value raises ValueError naming the valid choices."""
    config = methods.load_config(method)
    unknown = sorted(set(options) - set(config) - {"name"})
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for method {method!r}; valid options: "
                         f"{sorted(k for k in config if k not in ('name', 'kind'))}")
    config.update(options)
    m = methods.build(config)
    m.prepare(model)
    handle = Handle(model, m, config)
    if measure:
        handle.measure_next()
    return handle


def prepare_config(model: nn.Module, cfg, measure: bool = False) -> Handle:
    """:func:`prepare` from a composed ``method`` config group (its ``name`` and options), as the runner does."""
    from omegaconf import OmegaConf
    options = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    name = options.pop("name")
    return prepare(model, str(name), measure=measure, **options)


__all__ = ["prepare", "prepare_config", "Handle"]


def compile_model(model: nn.Module, method, **options) -> nn.Module:
    """``trainer.compile=true``: ``model.compile()`` in place where the method allows it; otherwise a clear,
    early error naming the method. Compressing methods take their compile route (the model's own layers,
    the compiled graph's saved maps encoded through saved-tensor hooks: compress/saved_hooks.py).
    Checkpointing (context functions) and swap (hooks of its own) are not compilable."""
    if getattr(method, "compiles_itself", False):
        return model
    if hasattr(method, "compile_route"):
        method.compile_route(model)
    elif not getattr(method, "compilable", False):
        raise ValueError(f"trainer.compile=true does not work with method {method.name!r}: its layers run autograd "
                         "functions that keep Python-side state (Dynamo cannot compile them). Methods that can: "
                         "fp, compile_budget and the compressing methods (division, division_plus, actnn, ...); "
                         "or set trainer.compile=false")
    import torch._dynamo.utils
    torch._dynamo.utils.counters.clear()
    # A codec traced into the graphs plans each saved map by its shape while tracing the forward; symbolic
    # (dynamic) shapes would reach the backward's trace as foreign symbols. A new batch size recompiles instead.
    static = getattr(getattr(method, "saved_tensor_route", None), "static_shapes", False)
    if static:
        if options.get("dynamic"):
            raise ValueError(f"dynamic={options['dynamic']!r} does not work with method {method.name!r}: its codec "
                             "is planned per map shape while the forward is traced; valid: dynamic=False or None "
                             "(a new batch size then recompiles)")
        options["dynamic"] = False
    compile_in_place(model, **options)
    return model


def compile_in_place(model: nn.Module, **options) -> None:
    """What ``model.compile(**options)`` does (``model._compiled_call_impl``: the module's own call, hooks
    included, compiled), through a frame of ours: ``Module.compile`` compiles ``Module._call_impl`` itself, and
    where the forward is PyTorch's own too (an ``nn.Sequential`` of layers) Dynamo up to torch 2.11 (the GPU
    image's) skipped every frame of the call as PyTorch's code and ran it all eagerly, without a word (PyTorch
    issue 150915, fixed by PR 185722). From our frame Dynamo traces into the module's call as into any other.

    The frame's code object is the model's own: Dynamo keeps compiled graphs on the code object, at most
    ``recompile_limit`` (8) of them, so with one code shared by every model compiled in a process the ninth
    model of another architecture ran eagerly, with only a logged warning (torch 2.11 and 2.14 alike)."""
    def call(*args, **kwargs):
        return model._call_impl(*args, **kwargs)
    call.__code__ = call.__code__.replace()  # a copy: its own cache of compiled graphs
    model._compiled_call_impl = torch.compile(call, **options)


def graph_breaks() -> int:
    """Graph breaks Dynamo counted since :func:`compile_model`."""
    import torch._dynamo.utils
    return int(sum(torch._dynamo.utils.counters["graph_break"].values()))
