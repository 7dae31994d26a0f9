"""Baselines that trade time for memory without changing values: activation checkpointing and swapping."""
import collections
import contextlib
import inspect
import types

import torch
import torch.nn as nn
from torch.utils.checkpoint import SelectiveCheckpointContext, checkpoint

from division.memory import TensorIds, parameter_storages, storage_key
from division.methods.base import Method, frozen_batchnorm_stats

# torch >= 2.12 shows a selective-checkpoint policy each op's output and asks whether checkpoint's own saves go
# through outer saved-tensor hooks; torch 2.11 (the GPU image's) does neither, and forwards unknown keywords to
# the checkpointed function: use each where the signature has it.
_POLICY_SEES_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters
_IGNORE_OUTER_HOOKS = types.MappingProxyType(
    {"respect_saved_tensors_hooks": False}
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})

GRANULARITIES = ("stage", "block")


def _segments(model: nn.Module, granularity: str):
    """Stages: the outermost nn.Sequential containers with two or more children (ResNet's layer1..4,
    DenseNet's features). Blocks: the children of those stages."""
    stages = []

    def visit(m):
        for child in m.children():
            if isinstance(child, nn.Sequential) and len(child) >= 2:
                stages.append(child)
            else:
                visit(child)
    visit(model)
    if granularity == "stage":
        return stages
    return [block for stage in stages for block in stage.children()]


class Checkpoint(Method):
    """torch.utils.checkpoint (non-reentrant) over stages or blocks: only each segment's input is held,
    and the segment's forward is recomputed in backward."""

    name = "checkpoint"

    def __init__(self, name=None, granularity: str = "stage"):
        super().__init__(name)
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity={granularity!r} is invalid; valid choices: {list(GRANULARITIES)}")
        self.granularity = granularity
        self._inputs = {}
        self._kept = {}
        self._ids = TensorIds()

    def prepare(self, model):
        segments = _segments(model, self.granularity)
        if not segments:
            raise ValueError(f"{type(model).__name__} has no nn.Sequential stages to checkpoint")
        method = self

        def begin(mod, args):
            method._inputs, method._kept, method._ids = {}, {}, TensorIds()

        for seg in segments:
            plain = type(seg).forward

            def forward(self, x, _plain=plain):
                if not (method.enabled and self.training and torch.is_grad_enabled()):
                    return _plain(self, x)
                key = method._ids(x)
                method._inputs.setdefault(key, (x.untyped_storage().nbytes(), x.numel() * x.element_size()))
                return method._checkpoint(_plain, self, x)
            seg.forward = types.MethodType(forward, seg)
            self.covered.append(type(seg).__name__)
        self._handles = [model.register_forward_pre_hook(begin)]
        self.notes = [f"{len(segments)} {self.granularity} segments recomputed in backward; held = their inputs "
                      "plus what autograd keeps outside them"]
        return model

    def _checkpoint(self, plain, module, x):
        ctx = (lambda: (contextlib.nullcontext(), frozen_batchnorm_stats(module)))
        return checkpoint(plain, module, x, use_reentrant=False, context_fn=ctx)

    def ids(self):
        return self._ids

    def policy_records(self):
        from division.memory import SaveRecord
        return [SaveRecord("segment input", "checkpoint", "full", (), fp, [(key[:3], nbytes)], fp_key=key)
                for key, (nbytes, fp) in self._inputs.items()]


SAC_SAVED_OPS = ("convolution", "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


class SelectiveCheckpoint(Checkpoint):
    """PyTorch's selective activation checkpointing (``torch.utils.checkpoint`` with
    ``create_selective_checkpoint_contexts``) per block: the outputs of convolutions and matrix products are
    kept, everything else (batch norm, ReLU, additions) is recomputed in backward. Held bytes = the block
    inputs, the kept outputs (recorded as the policy decides, since SAC keeps them outside autograd's saved
    tensors), and what autograd keeps outside the blocks."""

    name = "sac"

    def __init__(self, name=None, granularity: str = "block", saved_ops=SAC_SAVED_OPS):
        super().__init__(name, granularity)
        unknown = [op for op in saved_ops if not hasattr(torch.ops.aten, op)]
        if unknown:
            raise ValueError(f"saved_ops {unknown} are not aten operators; valid examples: {list(SAC_SAVED_OPS)}")
        self.saved_ops = frozenset(getattr(torch.ops.aten, op) for op in saved_ops)
        self._kept = {}

    def _context(self, module):
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
        method = self

        def policy(ctx, op, *args, **kwargs):
            if op.overloadpacket in method.saved_ops:
                if not ctx.is_recompute and _POLICY_SEES_OUTPUT:
                    method._record_kept(ctx.op_output)
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE
        caching, cached = create_selective_checkpoint_contexts(policy)
        if not _POLICY_SEES_OUTPUT:  # torch 2.11: record what the mode caches as it caches it
            caching.storage = cached.storage = _RecordingStorage(self._record_kept)
        return caching, _Both(frozen_batchnorm_stats(module), cached)  # statistics frozen outside the mode

    def _record_kept(self, outputs):
        """Note each kept output tensor's storage once (bytes held, bytes of the tensor)."""
        for out in torch.utils._pytree.tree_leaves(outputs):
            out = getattr(out, "val", out)  # torch 2.11's cache entries wrap the tensor
            if isinstance(out, torch.Tensor):
                nbytes = out.untyped_storage().nbytes()
                self._kept.setdefault(self._ids(out), (nbytes, out.numel() * out.element_size()))

    def _checkpoint(self, plain, module, x):
        return checkpoint(plain, module, x, use_reentrant=False, context_fn=lambda: self._context(module),
                          **_IGNORE_OUTER_HOOKS)

    def policy_records(self):
        from division.memory import SaveRecord
        kept = [SaveRecord("selectively saved output", "sac", "full", (), fp, [(key[:3], nbytes)], fp_key=key)
                for key, (nbytes, fp) in self._kept.items()]
        return super().policy_records() + kept


class _RecordingStorage(collections.defaultdict):
    """SAC's cache (op -> list of kept outputs) that reports each entry as it is added: torch 2.11's policy
    functions are called before the op runs and never see its output (``SelectiveCheckpointContext.op_output``
    came later)."""

    def __init__(self, record):
        super().__init__(lambda: _RecordingList(record))


class _RecordingList(list):
    def __init__(self, record):
        super().__init__()
        self._record = record

    def append(self, entry):
        self._record(entry)
        super().append(entry)


class _Both(contextlib.ContextDecorator):
    """Two context managers entered in order and left in reverse, as one (frozen batch-norm statistics, then
    the recompute mode)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __enter__(self):
        self.first.__enter__()
        self.second.__enter__()
        return self

    def __exit__(self, *exc):
        self.second.__exit__(*exc)
        return self.first.__exit__(*exc)


class Swap(Method):
    """Saved activations go to (pinned) host memory during forward and come back in backward, as
    ``torch.autograd.graph.save_on_cpu`` does. Its own saved-tensor hooks also do the accounting (an inner
    hook hides tensors from any outer one): bytes moved to the host, and bytes left on the device
    (parameters, which are not counted, and tensors already in host memory). Bypassed, it moves nothing.
    On a CPU-only machine it moves nothing either: it is plain training, and the report says so."""

    name = "swap"

    def __init__(self, name=None, pin_memory: bool = True):
        super().__init__(name)
        self.pin_memory = pin_memory
        self._host_bytes = 0
        self._recorder = None
        self._params = frozenset()

    def _pack(self, t):
        if t.device.type == "cpu" or storage_key(t) in self._params or isinstance(t, torch.nn.Parameter):
            return (None, t.detach()) if self._recorder is None else (None, self._recorder._pack(t))
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout,
                           pin_memory=self.pin_memory and torch.cuda.is_available())
        host.copy_(t, non_blocking=self.pin_memory)
        self._host_bytes += t.numel() * t.element_size()
        if self._recorder is not None:
            self._recorder.fp_only(t)
        return (t.device, host)

    @staticmethod
    def _unpack(packed):
        if not isinstance(packed, tuple):
            return packed
        device, t = packed
        return t if device is None else t.to(device, non_blocking=True)

    def prepare(self, model):
        params = list(model.parameters())
        if not params or params[0].device.type == "cpu":
            self.notes = ["swap is a no-op on CPU: activations already live in host memory"]
        else:
            self.notes = ["saved activations live in pinned host memory; act_mem_bytes counts device bytes only, "
                          "act_mem_host_bytes what went to the host"]
        state = {}

        def enter(mod, args):
            if self.enabled and mod.training and torch.is_grad_enabled():
                self._host_bytes = 0
                self._params = parameter_storages(mod)
                ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                state["ctx"] = ctx
                ctx.__enter__()

        def leave(mod, args, out):
            ctx = state.pop("ctx", None)
            if ctx is not None:
                ctx.__exit__(None, None, None)
        self._handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
        return model

    @contextlib.contextmanager
    def accounting(self, model=None, inputs=None):
        """The swap hooks are innermost, so they report to this step's recorder themselves."""
        with super().accounting(model, inputs) as acc:
            self._recorder = acc.recorder
            try:
                yield acc
            finally:
                self._recorder = None

    def host_bytes(self) -> int:
        return self._host_bytes
