"""Accounting of the bytes a training step holds for backward, de-duplicated by storage.

Two sources are merged: the records a method's policy wrote while compressing (what its autograd
functions keep), and every tensor plain autograd saved outside them (observed through
``torch.autograd.graph.saved_tensors_hooks``). Parameters are never counted: they exist anyway.
"""
import contextlib
from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.nn as nn

from division.compress import TensorIds


@dataclass
class MemoryReport:
    held_bytes: int  # bytes alive for backward, de-duplicated by storage
    fp_bytes: int  # what plain full-precision autograd would hold for the same layers
    layers: List[dict] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    host_bytes: int = 0  # bytes moved off the device (swap)

    @property
    def ratio(self) -> float:
        return self.fp_bytes / self.held_bytes if self.held_bytes else float("inf")

    def summary(self) -> dict:
        return {"act_mem_bytes": self.held_bytes, "act_mem_fp_bytes": self.fp_bytes,
                "act_compression": round(self.ratio, 4), "act_mem_host_bytes": self.host_bytes,
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
        return "\n".join(lines)


class SavedTensorRecorder:
    """Observes every tensor autograd saves (outside the methods' own functions) without changing it."""

    def __init__(self, ids=None):
        self.tensors: Dict[tuple, tuple] = {}
        self.ids = ids if ids is not None else TensorIds()

    def _pack(self, t):
        if not isinstance(t, nn.Parameter) and t.layout == torch.strided:
            key = self.ids(t)
            if key not in self.tensors:
                self.tensors[key] = (tuple(t.shape), t.untyped_storage().nbytes(), str(t.dtype))
        # detach(): the same storage without the autograd history; returning ``t`` itself would tie a
        # saved output to its own grad_fn, a cycle that leaks the graph when it is dropped without backward
        return t.detach()

    @contextlib.contextmanager
    def record(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self


def build_report(policy_records, recorder: SavedTensorRecorder, notes=(), host_bytes: int = 0) -> MemoryReport:
    """Merge a policy's records with what autograd saved elsewhere; every storage counts once."""
    held: Dict[tuple, int] = {}
    fp: Dict[tuple, int] = {}
    layers = []
    anonymous = 0
    for r in policy_records:
        new = 0
        for key, nbytes in r.held:
            if key not in held:
                held[key] = nbytes
                new += nbytes
        fp_key = r.fp_key if r.fp_key is not None else ("record", anonymous)
        anonymous += 1
        fp_new = 0 if fp_key in fp else r.fp_bytes
        fp.setdefault(fp_key, r.fp_bytes)
        layers.append({"layer": r.layer, "kind": r.kind, "codec": r.codec + (" (shared)" if r.shared else ""),
                       "shape": list(r.shape), "fp_bytes": fp_new, "held_bytes": new})
    for key, (shape, nbytes, dtype) in recorder.tensors.items():
        new_held = 0 if key[:3] in held else nbytes
        held.setdefault(key[:3], nbytes)
        new_fp = 0 if key in fp else nbytes
        fp.setdefault(key, nbytes)
        if new_held or new_fp:
            layers.append({"layer": "(autograd)", "kind": "other", "codec": f"full {dtype}", "shape": list(shape),
                           "fp_bytes": new_fp, "held_bytes": new_held})
    return MemoryReport(sum(held.values()), sum(fp.values()), layers, list(notes), host_bytes)
