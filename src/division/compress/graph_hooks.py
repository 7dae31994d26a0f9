"""The torch.compile route with the codecs inside the compiled graphs.

Saved-tensor hooks given as ``torch.fx.GraphModule`` s are not run by autograd at run time: AOTAutograd
traces them into the compiled graphs (PyTorch PR 150032, for issue 148222 "make saved_tensor_hooks work
better in compile for doing activation compression"). The encode becomes the forward graph's epilogue and
the decode the backward graph's prologue, so the compiler generates and fuses the codec's kernels (C++ on a
CPU, Triton on a GPU) with the model's own, and no Python runs per step. For that the codecs here are plain
tensor operations without data-dependent control flow: DIVISION (block-average LFC plus a b-bit HFC per
(sample, channel) map) and ActNN-style groups, with stochastic rounding from the compiled graph's random
numbers, codes packed ``8 // bits`` to a byte.

Which saved tensors are encoded is decided when the graph is traced, from the saved node itself (AOTAutograd
shows the hook the node and the backward graph; only the graph's own intermediates are offered, never its
inputs or parameters): floating-point 4-D maps where encoding pays off (``TracedCodec.pays_off``; smaller
maps in bf16, as the eager codec keeps them). ReLU outputs are saved rather than recomputed in the backward
(:class:`SaveReluOutputs`); with the method's ``fuse_bn_relu`` they are not held at all, only their exact
masks, and the backward rebuilds them from the ReLU's input (:class:`ExactReluMasks`). A map that the
backward compares with zero (a ReLU's ``le(out, 0)`` mask) also keeps one exact bit per element saying
whether it is > 0, without which a decoded zero that came back positive would let gradient through. Boolean
4-D masks the graph saves are packed eight to a byte (on a CPU by the kernel library's operators). Everything
else is held as the graph holds it. Where the kernel operators take a map (compress/ops.py: the C kernel on a
CPU, the Triton codec on CUDA) it goes through them instead of the traced operations, unless the method's
backend is ``reference``.

Held bytes are what the compiled function really saves (its autograd node's saved tensors after the
forward, de-duplicated by storage); the per-map breakdown comes from the trace.
"""
import contextlib
import operator
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from division.codecs.division import block_average, lfc_blocks, map_nbytes, upsample_blocks
from division.compress import ops

COMPARISONS = {"aten.le.Scalar", "aten.lt.Scalar", "aten.gt.Scalar", "aten.ge.Scalar", "aten.eq.Scalar",
               "aten.threshold_backward.default"}
POINTWISE = {"aten.sub.Tensor", "aten.add.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.relu.default",
             "aten.convert_element_type.default", "aten._to_copy.default"}
KINDS = ("division", "groups")


@dataclass(frozen=True)
class TracedCodec:
    """A codec the compiled graph can run: ``division`` (LFC over ``block`` x ``block`` blocks in
    ``lfc_dtype`` plus ``bits``-bit HFC per map) or ``groups`` (``bits``-bit codes per ``group`` elements)."""

    kind: str = "division"
    bits: int = 2
    block: int = 8
    group: int = 256
    lfc_dtype: torch.dtype = torch.bfloat16
    stochastic: bool = True
    min_map_elems: int = 9  # smaller maps (and those DIVISION would keep in more bytes than bf16) go to bf16
    kernels: bool = True  # maps through the fused kernels as custom operators (compress/ops.py): the C kernel
    # on a CPU, Triton on CUDA; False (method.backend=reference): the traced operations below, left to Inductor
    save_relu_outputs: bool = True  # the partitioner saves ReLU outputs instead of recomputing them (see below)
    exact_relu_masks: bool = False  # fuse_bn_relu: ReLU outputs not held, rebuilt from their inputs and exact
    # masks in the backward (ExactReluMasks); replaces save_relu_outputs

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"traced codec kind={self.kind!r} is invalid; valid choices: {list(KINDS)}")
        if self.bits not in (1, 2, 4, 8):
            raise ValueError(f"traced codec bits={self.bits!r} is invalid; valid choices: [1, 2, 4, 8]")
        for key in ("block", "group", "min_map_elems"):
            if getattr(self, key) < 1:
                raise ValueError(f"traced codec {key}={getattr(self, key)!r} is invalid; it must be >= 1")

    def pays_off(self, h: int, w: int) -> bool:
        """Whether an h x w map is worth encoding: at least ``min_map_elems`` elements, and (DIVISION) its LFC,
        codes and two float32 statistics take fewer bytes than bf16 would (the eager codec's rule)."""
        if h * w < self.min_map_elems:
            return False
        if self.kind != "division":
            return True
        return map_nbytes(h, w, self.block, self.bits, self.lfc_dtype.itemsize, 4) < 2 * h * w


# --- codes and bits as plain tensor operations ------------------------------------------------------------

def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, L) uint8 codes below 2**bits -> (R, ceil(L * bits / 8)) bytes, the first code in the low bits."""
    per = 8 // bits
    rows, length = codes.shape
    pad = -length % per
    if pad:
        codes = F.pad(codes, (0, pad))
    codes = codes.view(rows, -1, per)
    out = codes[:, :, 0]
    for i in range(1, per):
        out = out | (codes[:, :, i] << (i * bits))
    return out


def unpack_codes(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: (R, P) bytes -> (R, length) uint8 codes."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], -1)[:, :length] if per > 1 else packed[:, :length]


MASK32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding 32-bit values: every input bit flips about
    half of the output bits."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def uniform_like(rows: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in [0, 1) (24 bits) for each element of ``rows``, a hash of the element's position and
    ``seed`` (an int64 scalar tensor). Not ``torch.rand``: random ops that a saved-tensor hook adds to a
    graph after Inductor's RNG pass cannot be lowered, while this is plain integer arithmetic that fuses
    into the encode kernel."""
    position = torch.arange(rows.numel(), dtype=torch.int64, device=rows.device).view(rows.shape)
    h = _mix32((position + _mix32(seed & MASK32) * 0x9E3779B1) & MASK32)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def statistics_seed(low: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A seed that changes whenever the map does: the bit patterns of its per-row statistics, summed. Every
    step's maps differ (data, weights), so every step draws afresh, with no random state to carry."""
    bits = low.float().view(torch.int32).to(torch.int64) * 31 + scale.float().view(torch.int32).to(torch.int64)
    return bits.sum() * 0x27D4EB2F


def quantize_rows(rows: torch.Tensor, bits: int, stochastic: bool):
    """Per-row minimum and scale, codes in [0, 2**bits - 1]; stochastic rounding is unbiased:
    E[floor(t + u)] = t for u uniform in [0, 1) and independent of t (here a hash of the position, seeded
    by the statistics of all rows: :func:`uniform_like`)."""
    levels = (1 << bits) - 1
    low = rows.amin(1, keepdim=True)
    scale = (rows.amax(1, keepdim=True) - low) / levels
    t = (rows - low) * torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    t = torch.floor(t + uniform_like(t, statistics_seed(low, scale))) if stochastic else torch.round(t)
    return pack_codes(t.clamp(0, levels).to(torch.uint8), bits), low, scale


def dequantize_rows(packed, low, scale, bits: int, length: int) -> torch.Tensor:
    return unpack_codes(packed, bits, length).float() * scale + low


def pack_bools(mask: torch.Tensor) -> torch.Tensor:
    return pack_codes(mask.reshape(1, -1).to(torch.uint8), 1)


def unpack_bools(packed: torch.Tensor, shape) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    return unpack_codes(packed, 1, numel).view(shape).bool()


# --- the two codecs -----------------------------------------------------------------------------------------

def encode(codec: TracedCodec, x: torch.Tensor):
    """Tensors that keep ``x`` (N, C, H, W) under ``codec``."""
    n, c, h, w = x.shape
    xf = x.float()
    if codec.kind == "division":
        block_hw = lfc_blocks(h, w, codec.block)
        lfc = block_average(xf, block_hw).to(codec.lfc_dtype)
        hfc = xf - upsample_blocks(lfc.float(), block_hw, h, w)
        return (lfc, *quantize_rows(hfc.reshape(n * c, h * w), codec.bits, codec.stochastic))
    per_sample = xf.reshape(n, -1)  # groups of contiguous elements within each sample, as ActNN's
    rows = F.pad(per_sample, (0, -per_sample.shape[1] % codec.group)).view(-1, codec.group)
    return quantize_rows(rows, codec.bits, codec.stochastic)


def decode(codec: TracedCodec, parts, shape) -> torch.Tensor:
    n, c, h, w = shape
    if codec.kind == "division":
        lfc, packed, low, scale = parts
        x = dequantize_rows(packed, low, scale, codec.bits, h * w).view(n, c, h, w)
        return x + upsample_blocks(lfc.float(), lfc_blocks(h, w, codec.block), h, w)
    packed, low, scale = parts
    return dequantize_rows(packed, low, scale, codec.bits, codec.group).view(n, -1)[:, :c * h * w].reshape(shape)


def encode_with_kernel(codec: TracedCodec, x: torch.Tensor, channels_last: bool = False):
    """DIVISION (or ActNN's groups) through the fused C kernel, one custom operator (compress/ops.py);
    ``channels_last``: the kernel for maps laid out (N, H, W, C), codes in that order."""
    if codec.kind == "groups":
        return torch.ops.division.encode_groups(x, codec.bits, codec.group, codec.stochastic)
    bh, bw = lfc_blocks(x.shape[2], x.shape[3], codec.block)
    op = torch.ops.division.encode_maps_cl if channels_last else torch.ops.division.encode_maps
    return op(x, codec.bits, bh, bw, codec.stochastic)


def decode_with_kernel(codec: TracedCodec, parts, shape, channels_last: bool = False,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`encode_with_kernel`; NCHW DIVISION maps decode straight into ``dtype`` (the Triton
    kernel writes it: no float32 copy of a half-precision map), the others into float32."""
    if codec.kind == "groups":
        return torch.ops.division.decode_groups(*parts, codec.bits, codec.group, list(shape))
    h, w = shape[2], shape[3]
    if channels_last:
        return torch.ops.division.decode_maps_cl(*parts, codec.bits, h, w, *lfc_blocks(h, w, codec.block))
    return torch.ops.division.decode_maps(*parts, codec.bits, h, w, *lfc_blocks(h, w, codec.block), dtype)


RELUS = {"aten.relu.default"}


def with_signs(x: torch.Tensor, positive: torch.Tensor, dtype: torch.dtype, relu: bool) -> torch.Tensor:
    """Decoded ``x`` made to agree with the exact signs: > 0 where ``positive`` (at least the dtype's epsilon,
    not its smallest normal: products of such values in the backward's convolutions would be denormals, which
    slowed a CPU step 5x), else <= 0, and exactly 0 for a ReLU's output (all its non-positive values are)."""
    up = x.clamp_min(torch.finfo(dtype).eps)
    return torch.where(positive, up, torch.zeros((), dtype=x.dtype) if relu else x.clamp_max(0))


def nbytes_of(parts) -> int:
    return sum(t.numel() * t.element_size() for t in parts)


@dataclass
class Plan:
    """What the trace decided for one saved node."""
    node: str
    shape: tuple
    dtype: torch.dtype
    action: str  # "encode" | "bits" (a boolean mask) | "relu mask" (bits already) | "bf16" | "keep"
    sign: bool = False
    kernel: bool = False  # encoded (or a mask packed) by the kernel operators (their layout), not the traced ops
    channels_last: bool = False  # by the C kernel's operators for maps laid out (N, H, W, C)
    groups: bool = False  # ActNN's groups (the kernel's group operators: no ReLU-sign variant)
    fp_bytes: int = 0
    held_bytes: int = 0
    users: List[str] = field(default_factory=list)
    producer: str = ""  # the forward op that made the saved tensor ("aten.relu.default": zero where not > 0)
    parts: List[tuple] = field(default_factory=list)  # (shape, dtype) of each tensor that keeps it

    @property
    def relu(self) -> bool:
        return self.producer in RELUS

    @property
    def kernel_signs(self) -> bool:
        """A ReLU output's sign bits made and applied by the kernel operators."""
        return self.sign and self.kernel and self.relu and not self.groups


def inlining_supported() -> bool:
    """Whether this torch inlines GraphModule saved-tensor hooks into compiled graphs (2.8 and later)."""
    try:
        from torch._functorch._aot_autograd.utils import saved_tensors_hooks_are_inlineable  # noqa: F401
    except ImportError:
        return False
    return True


def _hook_context():
    try:
        from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context
    except ImportError:  # a torch without the context (< 2.10): no node information
        return None
    return _get_saved_tensor_hook_context()


def _backward_placeholder(ctx):
    """The backward graph's input for the saved node the hook is tracing (None without that information)."""
    if not ctx or "_node" not in ctx or "_bw_graph" not in ctx:
        return None
    name = ctx["_node"].name
    return next((p for p in ctx["_bw_graph"].find_nodes(op="placeholder") if p.name == name), None)


def _relu_mask_bits(node) -> bool:
    """Whether a forward node is the bits of ExactReluMasks' ``relu_with_mask``."""
    return (node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node)
            and node.args[0].target is torch.ops.division.relu_with_mask.default and node.args[1] == 1)


def _compared_after_pointwise(node, depth: int = 8) -> bool:
    """Whether the backward compares a value computed from ``node`` by elementwise arithmetic alone (a
    batch norm and ReLU recomputed from the saved convolution output, to get the ReLU's mask)."""
    frontier = [u for u in node.users]
    for _ in range(depth):
        nxt = []
        for user in frontier:
            target = str(user.target)
            if target in COMPARISONS:
                return True
            if target in POINTWISE:
                nxt.extend(user.users)
        frontier = nxt
    return False


class GraphCodecHooks:
    """The pack and unpack GraphModules for one method's codec, and what the traces planned.

    Use one instance for every forward of a compiled model: Dynamo guards on the hooks' identity, and other
    hooks would recompile it."""

    static_shapes = True  # plans hold concrete shapes: the model is compiled with dynamic=False
    in_graph = True  # held bytes are read from the compiled functions' saved tensors (records())

    def __init__(self, codec: TracedCodec, keep_layouts: bool = False):
        self.codec = codec
        self.keep_layouts = keep_layouts  # see context()
        self.plans: Dict[tuple, Plan] = {}
        self._current: Optional[Plan] = None
        self.pack_gm = _graph_module(self._pack)
        self.unpack_gm = _graph_module(self._unpack)
        self.eager_saved = None  # called with tensors saved outside the compiled graph (the accounting's recorder)

    def _plan(self, x: torch.Tensor) -> Plan:
        ctx = _hook_context()
        placeholder = _backward_placeholder(ctx)
        users = sorted(str(u.target) for u in placeholder.users) if placeholder is not None else []
        node = ctx["_node"].name if ctx and "_node" in ctx else "?"
        producer = str(ctx["_node"].target) if ctx and "_node" in ctx else ""
        plan = Plan(node, tuple(x.shape), x.dtype, "keep", users=users, producer=producer,
                    fp_bytes=x.numel() * x.element_size())
        if x.dim() == 4 and x.dtype == torch.bool:
            plan.action = "bits"
        elif x.dim() == 4 and x.is_floating_point() and x.shape[2] * x.shape[3] > 1:
            plan.action, plan.sign = "encode", any(u in COMPARISONS for u in users)
            if not self.codec.pays_off(x.shape[2], x.shape[3]):
                plan.action, plan.sign = "bf16", False  # bf16 keeps every sign (and zero) as it was
            elif not plan.sign and placeholder is not None and _compared_after_pointwise(placeholder):
                plan.action = "bf16"  # a mask recomputed from decoded values would flip near zero
        if ctx and "_node" in ctx and _relu_mask_bits(ctx["_node"]):
            plan.action = "relu mask"  # ExactReluMasks' bits: already one bit per element
        if ctx and "_fw_graph" in ctx:
            self.plans[(id(ctx["_fw_graph"]), node)] = plan
        return plan

    def _pack(self, x):
        if _hook_context() is None:  # an eager save (the loss after the compiled model): left alone
            return self.eager_saved(x) if self.eager_saved is not None else x
        plan = self._current = self._plan(x)
        if plan.action == "bits":
            plan.kernel = self.codec.kernels and ops.masks_available(x)
            plan.channels_last = plan.kernel and ops.is_channels_last(x)
            parts = (torch.ops.division.pack_mask(x),) if plan.kernel else (pack_bools(x),)
        elif plan.action == "relu mask":
            parts = (x,)
        elif plan.action == "bf16":
            if x.dtype in (torch.bfloat16, torch.float16):  # already 2 bytes: nothing to gain
                plan.action = "keep"
                return x
            parts = (x.to(torch.bfloat16),)
        elif plan.action == "encode":
            plan.groups = self.codec.kind == "groups"
            if plan.groups:
                plan.kernel = self.codec.kernels and ops.groups_available(x)
            else:
                plan.kernel = self.codec.kernels and ops.available(x, self.codec)
            plan.channels_last = (plan.kernel and not plan.groups and x.device.type == "cpu"
                                  and ops.nhwc_supported(x))
            parts = encode_with_kernel(self.codec, x, plan.channels_last) if plan.kernel else encode(self.codec, x)
            if plan.sign:
                signs = torch.ops.division.relu_signs_cl if plan.channels_last else torch.ops.division.relu_signs
                parts = (*parts, signs(x) if plan.kernel_signs else pack_bools(x > 0))
        else:
            return x
        plan.held_bytes = nbytes_of(parts)
        plan.parts = [(tuple(t.shape), t.dtype) for t in parts]
        return parts

    def _unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        plan = self._current  # AOTAutograd traces a node's unpack right after its pack
        if plan.action == "relu mask":
            return packed[0]
        if plan.action == "bits":
            if plan.kernel:
                return torch.ops.division.unpack_mask(packed[0], list(plan.shape), plan.channels_last)
            return unpack_bools(packed[0], plan.shape)
        if plan.action == "bf16":
            return packed[0].to(plan.dtype)
        if plan.kernel_signs:
            h, w = plan.shape[2], plan.shape[3]
            args = (*packed, self.codec.bits, h, w, *lfc_blocks(h, w, self.codec.block),
                    float(torch.finfo(plan.dtype).eps))
            if plan.channels_last:
                return torch.ops.division.decode_relu_maps_cl(*args).to(plan.dtype)
            return torch.ops.division.decode_relu_maps(*args, plan.dtype)
        parts = packed[:-1] if plan.sign else packed
        if plan.kernel:
            x = decode_with_kernel(self.codec, parts, plan.shape, plan.channels_last, plan.dtype)
        else:
            x = decode(self.codec, parts, plan.shape)
        if plan.sign:
            x = with_signs(x, unpack_bools(packed[-1], plan.shape), plan.dtype, plan.relu)
        return x.to(plan.dtype)

    def records(self, output: torch.Tensor, ids, exclude, params, weight_casts: dict):
        """SaveRecords of what the compiled functions in ``output``'s graph really hold (one per saved tensor,
        de-duplicated by storage ids), labelled by the trace's plans; parameters and buffers (storages in
        ``exclude``) are left out and copies of ``params`` (a weight laid out for the compiled kernels) go to ``weight_casts``."""
        from division.codecs.base import storage_key
        from division.memory import SaveRecord
        free = {}
        for plan in self.plans.values():
            for part in plan.parts:
                free.setdefault(part, []).append(plan)
        params = [p.detach() for p in params]
        out, counted = [], set()
        for t in compiled_saved_tensors(output):
            if storage_key(t) in exclude:
                continue
            key, nbytes = ids(t), t.untyped_storage().nbytes()
            if any(p.shape == t.shape and p.dtype == t.dtype and torch.equal(p, t) for p in params):
                weight_casts.setdefault(key, nbytes)
                continue
            plans = free.get((tuple(t.shape), t.dtype))
            if plans:
                plan = plans.pop(0)
                fp = 0 if id(plan) in counted else plan.fp_bytes
                counted.add(id(plan))
                out.append(SaveRecord("(compiled graph)", plan.node, f"compiled {plan.action}" +
                                      (" + sign bits" if plan.sign else ""), plan.shape, fp, [(key, nbytes)],
                                      fp_key=("plan", id(plan)), backend="inductor"))
            else:
                out.append(SaveRecord("(compiled graph)", "saved", f"full {t.dtype}", tuple(t.shape), nbytes,
                                      [(key, nbytes)], fp_key=key))
        return out

    @contextlib.contextmanager
    def context(self):
        """Around a compiled model's forward (graphs compile lazily, inside it). The hooks are offered every
        saved tensor but parameters, as eager methods encode the model's input: a graph input is often a
        layout copy made for the compiled kernels (channels-last on a CPU), which only the graph holds."""
        passes = {}
        if self.codec.exact_relu_masks:
            passes["joint_custom_pre_pass"] = ExactReluMasks()
        elif self.codec.save_relu_outputs:
            passes["joint_custom_pre_pass"] = SaveReluOutputs()
        if self.keep_layouts:
            # On a CPU Inductor would turn convolutions channels-last; the C kernel's maps are NCHW, so every
            # saved map would be copied to NCHW and every decoded one reordered by the convolution's backward.
            # ResNet-50 b8 step: 1.21 s with NCHW kept, 1.38 s with the layout change (compiled fp: 1.03, 0.98).
            passes["layout_optimization"] = False
        with torch.autograd.graph.saved_tensors_hooks(self.pack_gm, self.unpack_gm), \
                torch._functorch.config.patch(saved_tensors_hooks_filtering_mode="no_static"), \
                torch._inductor.config.patch(**passes):
            yield self


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # an older torch: the pass is a plain callable (no caching of the compiled graphs)
    _PassBase = object


class SaveReluOutputs(_PassBase):
    """A joint-graph pass that marks every ReLU output MUST_SAVE. Left to itself the partitioner saves a
    convolution's output and recomputes batch norm and ReLU from it in the backward, mask included; a mask
    recomputed from a decoded map would flip near zero, so such a map had to stay in bf16 (2 bytes an element).
    With the ReLU output saved it is encoded with its exact sign bits, as eager DIVISION keeps it."""

    def __call__(self, graph) -> None:
        from torch.utils.checkpoint import CheckpointPolicy
        for node in getattr(graph, "graph", graph).nodes:
            if node.op == "call_function" and node.target is torch.ops.aten.relu.default:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE

    def uuid(self):
        return _source_hash("SaveReluOutputs")


def _source_hash(name: str) -> bytes:
    """A custom pass's cache key: Inductor reuses compiled graphs across processes by it, so it changes with
    this file's text (a fixed string kept graphs that an edited pass would have rewritten differently)."""
    from torch._inductor.custom_graph_pass import get_hash_for_files
    return get_hash_for_files((__file__,), extra=name)


ALIASES = {"aten.alias.default", "aten.view.default", "aten.detach.default"}


def _terminal_users(node):
    """(user, arg) pairs of ``node`` seen through alias and view nodes: ``arg`` is the node the user takes."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        for user in n.users:
            if str(user.target) in ALIASES and user.args and user.args[0] is n:
                stack.append(user)
            else:
                out.append((user, n))
    return out


def _forward_nodes(graph) -> set:
    """Nodes the joint graph's forward outputs need: ancestors of the outputs that use no tangent (gradients
    all do) and of the buffer updates (copy_ into running statistics)."""
    tangent_free = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            tangent_free[n] = "tangent" not in n.name
        else:
            tangent_free[n] = all(tangent_free.get(a, True) for a in n.all_input_nodes)
    roots = [n for n in graph.nodes if n.op == "call_function" and not n.users and tangent_free[n]]
    output = next(n for n in graph.nodes if n.op == "output")
    roots += [a for a in output.all_input_nodes if tangent_free[a]]
    seen, stack = set(), roots
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _call(g, target, *args):
    """A new node ``target(*args)`` in ``g`` (at the insertion point) with its value's metadata, which the
    partitioner sizes it by: ``target`` run on the arguments' fake values."""
    node = g.call_function(target, args)
    node.meta["val"] = target(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args])
    return node


def _is_zero(arg) -> bool:
    """Whether a graph argument is the constant 0 (a number or a scalar_tensor / full node of 0)."""
    if isinstance(arg, (int, float)):
        return arg == 0
    return (isinstance(arg, torch.fx.Node) and str(arg.target) in ("aten.scalar_tensor.default", "aten.full.default")
            and arg.args[-1] == 0)


class ExactReluMasks(_PassBase):
    """A joint-graph pass for methods with ``fuse_bn_relu``: a ReLU's output is not held for the backward,
    its exact mask is. Each 4-D ``relu(z)`` becomes ``division::relu_with_mask(z)``, which returns the output
    and the mask ``z > 0`` packed to bits (in the layout traced, see there); as an operator the partitioner
    may not recompute, it runs in the forward and its bits are what the backward keeps. In the backward the
    bits come back as uint8 0 / 1 (``m``): the ReLU's own gradient (``where(out <= 0, 0, g)`` or
    ``threshold_backward``) becomes ``g * m``, and whatever else the backward needs of the output (a
    convolution's input) becomes ``z * m``, which the partitioner recomputes from ``z``: after a batch norm,
    from the convolution output that the batch norm's backward keeps anyway. So a BN -> ReLU -> conv chain
    holds one encoded map and a bit mask, as eager ``fuse_bn_relu`` does, and the backward's mask is the
    forward's, never one recomputed from a decoded map. Without compression the gradients are those of the
    unmodified graph (``z * m`` is ``relu(z)`` up to the sign of zero, which no product or sum sees)."""

    def __call__(self, graph) -> None:
        g = getattr(graph, "graph", graph)
        forward = _forward_nodes(g)
        aten, division = torch.ops.aten, torch.ops.division
        for relu in [n for n in g.nodes if n.op == "call_function" and n.target is aten.relu.default]:
            uses = _terminal_users(relu)
            z = relu.args[0]
            if z.meta["val"].dim() != 4 or all(u in forward for u, _ in uses):
                continue  # only 4-D maps, and only those the backward uses
            val, channels_last = z.meta["val"], ops.is_channels_last(z.meta["val"])
            with g.inserting_before(relu):
                both = _call(g, division.relu_with_mask.default, z, channels_last)
                out, bits = _call(g, operator.getitem, both, 0), _call(g, operator.getitem, both, 1)
                mask = _call(g, division.unpack_mask_bytes.default, bits, list(val.shape), channels_last)
            for user, arg in uses:
                if user in forward or user.op == "output":
                    user.replace_input_with(arg, out)
                elif user.target is aten.le.Scalar and user.args[1] == 0:  # the ReLU's backward: where(le, 0, g)
                    for where in list(user.users):
                        if where.target is aten.where.self and where.args[0] is user and _is_zero(where.args[1]):
                            with g.inserting_before(where):
                                where.replace_all_uses_with(_call(g, aten.mul.Tensor, where.args[2], mask))
                            g.erase_node(where)
                    if user.users:  # any other use of the comparison: from the exact mask, as a bool
                        with g.inserting_before(user):
                            user.replace_all_uses_with(_call(g, aten.eq.Scalar, mask, 0))
                    g.erase_node(user)
                elif user.target is aten.threshold_backward.default and user.args[2] == 0:
                    with g.inserting_before(user):
                        user.replace_all_uses_with(_call(g, aten.mul.Tensor, user.args[0], mask))
                    g.erase_node(user)
                else:
                    with g.inserting_before(user):
                        user.replace_input_with(arg, _call(g, aten.mul.Tensor, z, mask))
        for node in reversed(list(g.nodes)):  # the alias chains the rewritten uses left behind, then the ReLUs
            if (str(node.target) in ALIASES or node.target is aten.relu.default) and not node.users:
                g.erase_node(node)
        g.lint()

    def uuid(self):
        return _source_hash("ExactReluMasks")


def _graph_module(fn) -> torch.fx.GraphModule:
    """A GraphModule of one call to ``fn``: AOTAutograd retraces it, running ``fn`` on the traced tensors."""
    graph = torch.fx.Graph()
    arg = graph.placeholder("x")
    graph.output(graph.call_function(fn, (arg,)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def compiled_saved_tensors(output: torch.Tensor) -> List[torch.Tensor]:
    """The tensors the compiled functions in ``output``'s autograd graph hold for backward."""
    seen, stack, found = set(), [output.grad_fn], []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "CompiledFunctionBackward" in type(fn).__name__ or "CompiledFunctionBackward" in fn.name():
            found.extend(t for t in fn.saved_tensors if isinstance(t, torch.Tensor))
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return found
