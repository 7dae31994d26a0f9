"""Accounting of the bytes a training step holds for backward, de-duplicated by storage (the process's peak
memory: division/peak.py).

Two sources are merged: the records a method's policy wrote while compressing (what its autograd
functions keep), and every tensor plain autograd saved outside them (observed through
``torch.autograd.graph.saved_tensors_hooks``). Parameters (and views of them, such as the ``weight.t()``
a Linear saves) are never counted: they exist anyway. The model's input is counted (plain autograd holds
it for the first layer) and also reported on its own (``input_*`` fields), so a ratio without it, the
paper's measure of memory allocated by the forward, can be taken from the same step. Under autocast, plain
autograd also saves the low-precision casts of weights; they are not activations either and are reported on
their own line (``amp_weight_cast_bytes``), outside both the held and the full-precision totals.
"""
import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from division.codecs.base import tensor_storages
from division.codecs.quant import storage_key


@dataclass
class SaveRecord:
    """What one layer holds for backward in the last training forward."""

    layer: str
    kind: str
    codec: str
    shape: tuple
    fp_bytes: int
    held: List[tuple] = field(default_factory=list)  # (storage key, nbytes) of tensors held
    fp_key: Optional[tuple] = None  # storage of the full-precision tensor plain autograd would hold
    shared: bool = False  # served from a tensor another layer already saved
    backend: str = ""  # the codec implementation that encoded it ("" when nothing was encoded)


class TensorIds:
    """Identity of a storage during one forward: its address plus a generation that changes when the storage
    first seen there has been freed, so a freed address reused by a new tensor is not taken for the old one.
    Holds only weak references: measuring identity keeps no memory alive."""

    def __init__(self):
        self._table: Dict[tuple, tuple] = {}
        self._next = 0

    def __call__(self, t: torch.Tensor) -> tuple:
        key = storage_key(t)
        entry = self._table.get(key)
        if entry is not None and not entry[0].expired():
            return key + (entry[1],)
        self._next += 1
        self._table[key] = (StorageWeakRef(t.untyped_storage()), self._next)
        return key + (self._next,)


@dataclass
class MemoryReport:
    held_bytes: int  # bytes alive for backward, de-duplicated by storage
    fp_bytes: int  # what plain full-precision autograd would hold for the same layers
    layers: List[dict] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    host_bytes: int = 0  # bytes moved off the device (swap)
    amp_weight_cast_bytes: int = 0  # autocast copies of weights saved by plain autograd (not activations)
    backends: Dict[str, int] = field(default_factory=dict)  # codec backend -> tensors it encoded
    input_held_bytes: int = 0  # of held_bytes: what is held for the model's input (its codes, or itself)
    input_fp_bytes: int = 0  # of fp_bytes: the model's input, as plain autograd holds it

    @property
    def ratio(self) -> float:
        return self.fp_bytes / self.held_bytes if self.held_bytes else float("inf")

    @property
    def ratio_without_input(self) -> float:
        """Compression of what the forward itself allocates (the paper's measure): the input left out of both."""
        held = self.held_bytes - self.input_held_bytes
        return (self.fp_bytes - self.input_fp_bytes) / held if held else float("inf")

    def use_fp_reference(self, fp) -> "MemoryReport":
        """Take the full-precision side from a measured reference (``Method.fp_reference``) of the same step."""
        self.fp_bytes, self.input_fp_bytes = fp.act_bytes, fp.input_bytes
        self.amp_weight_cast_bytes = max(self.amp_weight_cast_bytes, fp.amp_weight_cast_bytes)
        return self

    def summary(self) -> dict:
        return {"act_mem_bytes": self.held_bytes, "act_mem_fp_bytes": self.fp_bytes,
                "act_compression": round(self.ratio, 4), "act_mem_input_bytes": self.input_held_bytes,
                "act_mem_input_fp_bytes": self.input_fp_bytes,
                "act_compression_without_input": round(self.ratio_without_input, 4),
                "act_mem_host_bytes": self.host_bytes,
                "amp_weight_cast_bytes": self.amp_weight_cast_bytes, "codec_backends": dict(self.backends),
                "notes": list(self.notes)}

    def by_codec(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for row in self.layers:
            out[row["codec"]] = out.get(row["codec"], 0) + row["held_bytes"]
        return out

    def table(self, top: int = 0) -> str:
        rows = sorted(self.layers, key=lambda r: -r["held_bytes"]) if top else self.layers
        rows = rows[:top] if top else rows
        lines = [f"{'layer':40s} {'kind':8s} {'codec':14s} {'shape':22s} {'fp bytes':>12s} {'held':>12s}"]
        for r in rows:
            lines.append(f"{r['layer'][:40]:40s} {r['kind']:8s} {r['codec'][:14]:14s} {str(r['shape'])[:22]:22s} "
                         f"{r['fp_bytes']:12d} {r['held_bytes']:12d}")
        lines.append(f"total held {self.held_bytes} B, full precision {self.fp_bytes} B, ratio {self.ratio:.2f}x")
        if self.input_fp_bytes or self.input_held_bytes:
            lines.append(f"of which the model's input: held {self.input_held_bytes} B, full precision "
                         f"{self.input_fp_bytes} B; ratio without it {self.ratio_without_input:.2f}x")
        if self.amp_weight_cast_bytes:
            lines.append(f"autocast weight copies (not counted above) {self.amp_weight_cast_bytes} B")
        return "\n".join(lines)


def parameter_storages(model: Optional[nn.Module]) -> frozenset:
    """Storage keys of a model's parameters and buffers: saved tensors on them are not activations."""
    if model is None:
        return frozenset()
    return frozenset(storage_key(t) for t in (*model.parameters(), *model.buffers()))


@contextlib.contextmanager
def model_inputs(model: Optional[nn.Module], given=None):
    """Yields the set that the next forward of ``model`` fills with the storage keys of its tensor arguments
    (the caller's batch, held through backward by the caller anyway). ``given``: those arguments themselves,
    for a caller already inside the model's call (a forward pre-hook), where a hook added now would not run.

    A compiled model (``model.compile()``, :func:`division.api.compile_in_place`) compiles its forward hooks
    with its call, so a hook noting storages would be traced: under torch 2.11 Dynamo cannot trace
    ``untyped_storage().data_ptr()`` nor resume after it inside ``Module._call_impl``, and it then ran the whole
    model eagerly. For such a model the arguments are noted in a wrapper around the compiled call instead."""
    keys = tensor_storages(given or ())
    if given is not None or model is None:
        yield keys
        return
    compiled = getattr(model, "_compiled_call_impl", None)
    if compiled is not None:
        def noted_call(*args, **kwargs):
            keys.update(tensor_storages((*args, *kwargs.values())))
            return compiled(*args, **kwargs)
        model._compiled_call_impl = noted_call
        try:
            yield keys
        finally:
            model._compiled_call_impl = compiled
        return

    def note(module, args, kwargs):
        keys.update(tensor_storages((*args, *kwargs.values())))
    handle = model.register_forward_pre_hook(note, with_kwargs=True)
    try:
        yield keys
    finally:
        handle.remove()


def is_weight_cast(t: torch.Tensor) -> bool:
    """A dtype cast of a parameter (what autocast makes of a weight), or a view of one (a Linear saves
    ``weight.t()``): ToCopy straight from a leaf parameter."""
    base = t._base if t._is_view() and t._base is not None else t
    fn = base.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    nxt = fn.next_functions[0][0] if fn.next_functions else None
    return isinstance(getattr(nxt, "variable", None), nn.Parameter)


class SavedTensorRecorder:
    """Observes every tensor autograd saves (outside the methods' own functions).

    ``keep=True`` hands each tensor back to autograd unchanged (a real training step). ``keep=False``
    records shape and storage size and keeps nothing, so a forward measured this way frees each activation as
    soon as the forward itself no longer needs it: its graph can never run backward.
    """

    def __init__(self, ids=None, exclude=frozenset(), keep: bool = True):
        self.tensors: Dict[tuple, tuple] = {}
        self.ids = ids if ids is not None else TensorIds()
        self.exclude = exclude
        self.keep = keep
        self.weight_casts: Dict[tuple, int] = {}
        self.moved: Dict[tuple, tuple] = {}  # saved tensors a method moved off the device (fp-equivalent only)

    def _pack(self, t):
        if t.layout == torch.strided and not isinstance(t, nn.Parameter) and storage_key(t) not in self.exclude:
            key = self.ids(t)
            if is_weight_cast(t):
                self.weight_casts.setdefault(key, t.untyped_storage().nbytes())
            elif key not in self.tensors:
                self.tensors[key] = (tuple(t.shape), t.untyped_storage().nbytes(), str(t.dtype))
        if not self.keep:
            return None
        # detach(): the same storage without the autograd history; returning ``t`` itself would tie a
        # saved output to its own grad_fn, a cycle that leaks the graph when it is dropped without backward
        return t.detach()

    def fp_only(self, t: torch.Tensor):
        """Record a saved tensor that the method does not keep on the device (swap): it counts towards the
        full-precision equivalent, not towards the bytes held."""
        key = self.ids(t)
        if is_weight_cast(t):
            self.weight_casts.setdefault(key, t.untyped_storage().nbytes())
        else:
            self.moved.setdefault(key, (tuple(t.shape), t.untyped_storage().nbytes(), str(t.dtype)))

    @staticmethod
    def _unpack(t):
        if t is None:
            raise RuntimeError("backward through a forward measured with keep=False: it holds no tensors")
        return t

    def total_bytes(self) -> int:
        return sum(nbytes for _, nbytes, _ in self.tensors.values())

    def bytes_of(self, storages) -> int:
        """Bytes of the saved tensors on ``storages`` (storage keys, e.g. the model's input)."""
        return sum(nbytes for key, (_, nbytes, _) in self.tensors.items() if key[:3] in storages)

    @contextlib.contextmanager
    def record(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


def build_report(policy_records, recorder: SavedTensorRecorder, notes=(), host_bytes: int = 0,
                 inputs=frozenset()) -> MemoryReport:
    """Merge a policy's records with what autograd saved elsewhere; every storage counts once. ``inputs``:
    storage keys of the model's input, whose share of both totals is reported on its own."""
    held: Dict[tuple, int] = {}
    fp: Dict[tuple, int] = {}
    input_held = input_fp = 0
    layers = []
    backends: Dict[str, int] = {}
    anonymous = 0
    for r in policy_records:
        new = 0
        for key, nbytes in r.held:
            if key not in held:
                held[key] = nbytes
                new += nbytes
        if r.backend:
            backends[r.backend] = backends.get(r.backend, 0) + 1
        fp_key = r.fp_key if r.fp_key is not None else ("record", anonymous)
        anonymous += 1
        fp_new = 0 if fp_key in fp else r.fp_bytes
        fp.setdefault(fp_key, r.fp_bytes)
        if r.fp_key is not None and r.fp_key[:3] in inputs:
            input_held += new
            input_fp += fp_new
        layers.append({"layer": r.layer, "kind": r.kind, "codec": r.codec + (" (shared)" if r.shared else ""),
                       "shape": list(r.shape), "fp_bytes": fp_new, "held_bytes": new})
    for key, (shape, nbytes, dtype) in recorder.tensors.items():
        new_held = 0 if key[:3] in held else nbytes
        held.setdefault(key[:3], nbytes)
        new_fp = 0 if key in fp else nbytes
        fp.setdefault(key, nbytes)
        if key[:3] in inputs:
            input_held += new_held
            input_fp += new_fp
        if new_held or new_fp:
            layers.append({"layer": "(autograd)", "kind": "other", "codec": f"full {dtype}", "shape": list(shape),
                           "fp_bytes": new_fp, "held_bytes": new_held})
    for key, (shape, nbytes, dtype) in recorder.moved.items():
        if key not in fp:
            fp[key] = nbytes
            layers.append({"layer": "(autograd, moved off the device)", "kind": "other", "codec": f"host {dtype}",
                           "shape": list(shape), "fp_bytes": nbytes, "held_bytes": 0})
    return MemoryReport(sum(held.values()), sum(fp.values()), layers, list(notes), host_bytes,
                        sum(recorder.weight_casts.values()), backends, input_held, input_fp)


__all__ = ["MemoryReport", "SavedTensorRecorder", "build_report", "parameter_storages", "model_inputs", "is_weight_cast"]
