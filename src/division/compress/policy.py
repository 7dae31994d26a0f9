"""The saving policy: which codec keeps each tensor a layer saves for backward, one copy per tensor, and the
records of what one training forward held."""
import inspect
import weakref
from typing import Callable, Dict, List, Optional

import torch

from division.codecs.base import tensor_storages
from division.codecs.compact import ReluCompacted, compact_relu
from division.codecs.exact import InputReference
from division.codecs.fewbit import FewBitGelu, GeluDerivative, check_gelu_bits
from division.codecs.quant import BitMask, FullCopy, Packed, check_backend, storage_key
from division.compress.fused import BnOutput, BnReluInput, ResidualReluInput, ResidualSum
from division.memory import SaveRecord, TensorIds

LAYER_KINDS = ("conv", "bn", "linear", "relu", "maxpool", "dropout", "avgpool", "ln", "gelu", "attn")


def check_layer_kinds(kinds) -> tuple:
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in LAYER_KINDS]
    if bad:
        raise ValueError(f"unknown layer kind(s) {bad}; valid choices: {list(LAYER_KINDS)}")
    return kinds


class SavePolicy:
    """Holds a codec choice per tensor and the per-forward bookkeeping (dedup cache and records).

    ``choose(kind, x) -> Packed`` is the method's decision; ``reuse_relu_mask`` multiplies a rebuilt ReLU
    output by the ReLU's exact mask; ``fuse_bn_relu`` lets a convolution after BatchNorm -> ReLU rebuild its
    input from the batch norm's saved input (division/compress/fused.py) instead of holding a copy;
    ``keep_input`` holds the model's input (the caller's batch) by reference instead of encoding it;
    ``compact_relu`` keeps codes only for the positive elements of a ReLU output (division/codecs/compact.py);
    ``fuse_residual`` (with ``fuse_bn_relu``) lets a convolution whose input is relu(batch norm output +
    shortcut) rebuild it from the batch norm's saved input and the shortcut's (compress/fused.py);
    ``gelu_bits`` (1, 2 or 4; 0 = off) holds GELU's derivative in that many bits instead of its input
    (codecs/fewbit.py).
    """

    def __init__(self, choose: Callable[[str, torch.Tensor], Packed], kinds=LAYER_KINDS,
                 reuse_relu_mask: bool = False, backend: str = "auto", fuse_bn_relu: bool = False,
                 keep_input: bool = False, compact_relu: bool = False, fuse_residual: bool = False,
                 gelu_bits: int = 0):
        for name, value in (("fuse_bn_relu", fuse_bn_relu), ("keep_input", keep_input),
                            ("compact_relu", compact_relu), ("fuse_residual", fuse_residual)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is invalid; valid choices: [True, False]")
        if fuse_residual and not fuse_bn_relu:
            raise ValueError("fuse_residual=True needs fuse_bn_relu=True (it rebuilds from the batch norm's saved "
                             "input, which only fuse_bn_relu links)")
        self.fuse_bn_relu = fuse_bn_relu
        self.gelu = FewBitGelu(gelu_bits) if check_gelu_bits(gelu_bits) else None  # GELU' in a few bits
        self.fuse_residual = fuse_residual
        self.keep_input = keep_input
        self.compact_relu = compact_relu
        self._inputs: set = set()  # storage keys of this forward's model arguments (with keep_input)
        self._links: Dict[tuple, tuple] = {}
        self._pending: List["Saved"] = []
        self.choose = choose
        self._split_aware = "split" in inspect.signature(choose).parameters
        self._layer_aware = "layer" in inspect.signature(choose).parameters
        self.on_begin: Optional[Callable[[bool], None]] = None  # called first thing in begin_forward(training)
        self.backend = check_backend(backend)
        self.kinds = frozenset(check_layer_kinds(kinds))
        self.reuse_relu_mask = reuse_relu_mask
        self._cache: Dict[tuple, tuple] = {}
        self._masks: Dict[tuple, tuple] = {}
        self.records: List[SaveRecord] = []
        self.fused: Dict[str, Optional[str]] = {}  # this forward's convolutions whose input a batch norm's rebuilds
        self.residual: Dict[str, tuple] = {}  # this forward's residual rebuilds, described for the budget's probe
        self._rebuilt_by: Dict[int, str] = {}  # id of a rebuild object -> the convolution that reads it
        self._codes_site: Dict[int, str] = {}  # id of held codes -> their site ("layer:kind")
        self.ids = TensorIds()
        self.enabled = True

    def begin_forward(self, inputs=(), training: bool = True):
        """A new forward; ``inputs``: the model's arguments (noted only with ``keep_input``); ``training``:
        a training forward with the method active (``on_begin`` sees the previous forward's records)."""
        if self.on_begin is not None:
            self.on_begin(training)
        self._inputs = tensor_storages(inputs) if self.keep_input else set()
        self._cache = {}
        self._masks = {}
        self._links = {}
        self._pending = []
        self.records = []
        self.fused = {}
        self.residual = {}
        self._rebuilt_by = {}
        self._codes_site = {}
        self.ids = TensorIds()

    def end_forward(self):
        self.flush()
        self._cache = {}
        self._masks = {}
        self._links = {}
        self._inputs = set()

    def is_input(self, x: torch.Tensor) -> bool:
        """``x`` shares storage with an argument of this forward's model (noted with ``keep_input`` only; the
        arguments stay alive through the forward, so their addresses cannot be reused meanwhile)."""
        return storage_key(x) in self._inputs

    def _link(self, t: torch.Tensor, value, version: int):
        self._links[self._key(t)[:4]] = (weakref.ref(t), version, value)

    def _linked(self, t: torch.Tensor, kind):
        entry = self._links.get(self._key(t)[:4])
        if entry is None or entry[0]() is not t or entry[1] != t._version or not isinstance(entry[2], kind):
            return None
        return entry[2]

    def note_bn_output(self, out: torch.Tensor, saved: "Saved", weight, bias, mean, invstd, layer=None):
        """A training batch norm's output, for a ReLU that may follow (only with ``fuse_bn_relu``)."""
        if self.fuse_bn_relu:
            self._link(out, BnOutput(saved, weight, bias, mean, invstd, out.dtype, layer), out._version)

    def note_relu(self, x: torch.Tensor, bn: Optional[BnOutput], y: torch.Tensor, mask: BitMask, inplace: bool,
                  residual: Optional[ResidualSum] = None):
        """Link a ReLU output to the batch norm whose untouched output it consumed (``bn`` from
        :meth:`bn_output`, looked up before the ReLU ran), and encode that batch norm's input now, with the
        ReLU's mask as split (two ranges per map: the side a following conv rebuilds gets its own, narrower
        range); or to the residual sum it consumed (``residual`` from :meth:`residual_of`). An in-place
        ReLU's output gets one more version bump when its autograd function returns."""
        version = y._version + (1 if inplace else 0)
        if bn is not None:
            self.complete(bn.saved, mask)
            self._link(y, BnReluInput(bn, mask, y.shape), version)
        elif residual is not None:
            self._link(y, ResidualReluInput(residual, mask, y.shape, y.dtype), version)

    # --- fuse_residual: relu(batch norm output + shortcut) rebuilt, not held --------------------------------
    def residual_sum(self, a: torch.Tensor, b: torch.Tensor) -> Optional[ResidualSum]:
        """Before ``a + b`` runs: a ResidualSum if one side is a batch norm's untouched output and the other a
        shortcut this policy can rebuild and describe, else None."""
        if not self.fuse_residual or a.shape != b.shape:
            return None
        for bn_side, other in ((a, b), (b, a)):
            bn = self._linked(bn_side, BnOutput)
            source = self._rebuildable(other) if bn is not None and bn.layer is not None else None
            if source is not None:
                return ResidualSum(bn, source)
        return None

    def _rebuildable(self, t: torch.Tensor):
        linked = self._linked(t, (BnOutput, BnReluInput, ResidualReluInput))
        if isinstance(linked, BnOutput):
            return linked if linked.layer is not None else None
        if linked is not None:
            return linked if id(linked) in self._rebuilt_by else None
        hit = self._lookup(t)
        return hit[1] if hit is not None and id(hit[1]) in self._codes_site else None

    def note_residual(self, out: torch.Tensor, residual: ResidualSum):
        self._link(out, residual, out._version)

    def residual_of(self, x: torch.Tensor) -> Optional[ResidualSum]:
        return self._linked(x, ResidualSum) if self.fuse_residual else None

    def _describe(self, source) -> tuple:
        """A rebuild's sources by site, for the budget's probe (``residual``)."""
        if isinstance(source, ResidualReluInput):
            return ("res", f"{source.sum.bn.layer}:bn", self._describe_shortcut(source.sum.other))
        return ("bnrelu", f"{source.bn.layer}:bn")

    def _describe_shortcut(self, source) -> tuple:
        if isinstance(source, BnOutput):
            return ("bn", f"{source.layer}:bn")
        if isinstance(source, (BnReluInput, ResidualReluInput)):
            return ("conv", self._rebuilt_by[id(source)])
        return ("codes", self._codes_site[id(source)])

    def save_bn_input(self, x: torch.Tensor, layer: str) -> "Saved":
        """A batch norm's input. With ``fuse_bn_relu`` its encoding waits for a ReLU that may follow (see
        :meth:`note_relu`), at the latest until the next layer that calls the policy."""
        if not self.fuse_bn_relu or self._lookup(x) is not None:
            return self.save(x, "bn", layer)
        self.flush()
        saved = Saved(None, None, tuple(x.shape))
        saved.pending = (x, layer)
        self._pending.append(saved)
        return saved

    def complete(self, saved: "Saved", split: Optional[BitMask] = None):
        """Encode a waiting batch-norm input (with ``split`` where the method's codec takes one)."""
        if saved.pending is None:
            return
        x, layer = saved.pending
        saved.pending = None
        done = self.save(x, "bn", layer, split)
        saved.packed, saved.mask = done.packed, done.mask

    def flush(self):
        pending, self._pending = self._pending, []
        for saved in pending:
            self.complete(saved)

    def note_exact(self, y: torch.Tensor, levels):
        """``y`` holds only the values ``levels`` describes (WRPN's quantized activations)."""
        self._link(y, levels, y._version)

    def exact_levels(self, x: torch.Tensor):
        """What :meth:`note_exact` noted for ``x`` (unchanged since), else None."""
        value = self._linked(x, object)
        return None if isinstance(value, (BnOutput, BnReluInput)) else value

    def bn_output(self, x: torch.Tensor) -> Optional[BnOutput]:
        return self._linked(x, BnOutput) if self.fuse_bn_relu else None

    @staticmethod
    def _key(x: torch.Tensor) -> tuple:
        return (storage_key(x), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x._version)

    def _relu_mask(self, x: torch.Tensor):
        """The exact mask of the ReLU whose output ``x`` is, if ``x`` is unchanged since."""
        entry = self._masks.get(self._key(x)[:4])
        return entry[1] if entry is not None and entry[0]() is x and entry[2] == x._version else None

    def _lookup(self, x: torch.Tensor):
        hit = self._cache.get(self._key(x))
        if hit is None or hit[0]() is None:
            return None
        return hit

    def save(self, x: torch.Tensor, kind: str, layer: str, split: Optional[BitMask] = None) -> "Saved":
        """Compress ``x`` for a layer of ``kind``, or reuse what was saved for the very same tensor."""
        if kind != "bn" or split is None:
            self.flush()
        fused = self._linked(x, (BnReluInput, ResidualReluInput)) if kind == "conv" and self.fuse_bn_relu else None
        if fused is not None:
            residual = isinstance(fused, ResidualReluInput)
            if residual:
                self.residual[layer] = self._describe(fused)
            else:
                self.fused[layer] = fused.bn.layer
            self._rebuilt_by.setdefault(id(fused), layer)
            self.records.append(SaveRecord(layer, kind, "residual recompute" if residual else "bn-relu recompute",
                                           tuple(x.shape), x.numel() * x.element_size(), fp_key=self.ids(x),
                                           shared=True))
            return fused
        hit = self._lookup(x)
        packed = hit[1] if hit is not None else None
        mask = hit[2] if hit is not None else None
        if mask is None:
            mask = self._relu_mask(x)
        record = SaveRecord(layer, kind, "", tuple(x.shape), x.numel() * x.element_size(),
                            fp_key=self.ids(x))
        if packed is not None:
            record.codec, record.shared = packed.kind, True
        else:
            compact = self.compact_relu and mask is not None and split is None
            split = mask if compact else split
            if self.keep_input and self.is_input(x):
                packed = InputReference.encode(x)
            else:
                args = (split,) if split is not None and self._split_aware else ()
                packed = self.choose(kind, x, *args, **({"layer": layer, "compact": mask if compact else None}
                                                         if self._layer_aware else {}))
            if compact:
                packed = compact_relu(packed, mask, self.backend)
            record.codec = packed.kind
            record.backend = "" if packed.backend == "none" else packed.backend
            record.held = _held(packed.tensors())
            self._cache[self._key(x)] = (weakref.ref(x), packed, mask)
            self._codes_site[id(packed)] = f"{layer}:{kind}"
        self.records.append(record)
        use_mask = mask if (self.reuse_relu_mask and packed.kind not in ("full", "input", "exact")
                            and not isinstance(packed, ReluCompacted)) else None
        return Saved(packed, use_mask, tuple(x.shape))

    def save_mask(self, y: torch.Tensor, mask: BitMask, kind: str, layer: str, fp_bytes: int, fp_key=None,
                  inplace: bool = False):
        """Record an exact mask (ReLU, dropout) and remember it for a later compression of ``y`` (an in-place
        ReLU's output gets one more version bump when its autograd function returns)."""
        self.flush()
        self.records.append(SaveRecord(layer, kind, mask.kind, tuple(y.shape), fp_bytes, _held([mask.packed]),
                                       fp_key=fp_key, backend=mask.backend))
        if kind == "relu":
            self._masks[self._key(y)[:4]] = (weakref.ref(y), mask, y._version + (1 if inplace else 0))

    def save_extra(self, t: torch.Tensor, kind: str, layer: str, codec: str, fp_bytes: int, fp_key=None):
        self.flush()
        self.records.append(SaveRecord(layer, kind, codec, tuple(t.shape), fp_bytes, _held([t]), fp_key=fp_key))

    def save_gelu(self, x: torch.Tensor, layer: str, approximate: str) -> GeluDerivative:
        """GELU's derivative at ``x`` in ``gelu_bits`` bits (codecs/fewbit.py), held instead of ``x``."""
        self.flush()
        packed = self.gelu.encode(x, approximate)
        self.records.append(SaveRecord(layer, "gelu", packed.kind, tuple(x.shape), x.numel() * x.element_size(),
                                       _held(packed.tensors()), fp_key=self.ids(x), backend=packed.backend))
        return packed

    def save_nothing(self, kind: str, layer: str, shape, fp_bytes: int, fp_key=None):
        self.flush()
        self.records.append(SaveRecord(layer, kind, "none", tuple(shape), fp_bytes, [], fp_key=fp_key))


def _held(tensors) -> list:
    """(storage key, bytes) of each tensor held (None entries skipped), as a SaveRecord lists them."""
    return [(storage_key(t), t.untyped_storage().nbytes()) for t in tensors if t is not None]


class Saved:
    """A packed activation and, with ``reuse_relu_mask``, the exact mask of the ReLU that produced it.
    ``pending`` holds (tensor, layer) while a batch norm's input waits for its encoding; ``decoded`` a decode
    handed on to the next reader (the fused conv's backward to the batch norm's)."""

    __slots__ = ("packed", "mask", "packed_shape", "pending", "decoded")

    def __init__(self, packed: Packed, mask: Optional[BitMask], shape=None):
        self.packed, self.mask, self.packed_shape, self.pending, self.decoded = packed, mask, shape, None, None

    def keep_decoded(self, x: torch.Tensor):
        """Hand ``x`` (this tensor decoded) to the next :meth:`decode`, once."""
        self.decoded = x

    def decode(self) -> torch.Tensor:
        x, self.decoded = self.decoded, None
        if x is None:
            x = self.packed.decode()
        return x if self.mask is None else self.mask.apply(x)


def full_copy(kind: str, x: torch.Tensor, split=None) -> Packed:
    return FullCopy(x)
