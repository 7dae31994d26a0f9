"""Methods that keep compressed copies of activations through the saving policy (DIVISION, ActNN-style,
BLPA, the per-channel ablation). They differ only in which codec keeps which tensor."""
import time
from abc import ABCMeta, abstractmethod
from functools import partial
from typing import Optional

import torch
import torch.nn as nn

from division import compress
from division.codecs import Bf16Copy, BlpaCodec, DivisionCodec, GroupwiseCodec, PerChannelCodec
from division.codecs.compact import compact_relu
from division.codecs.tokens import ChannelCodec, encode_tokens, on_grid
from division.methods.base import Method

EXACT_KINDS = ("relu", "maxpool", "dropout", "avgpool")


class PolicyMethod(Method, metaclass=ABCMeta):
    """A method defined by a codec per tensor; ReLU/dropout masks, max-pool indices and average pools are
    exact in all of them. ``keep_input``: the model's input is held exactly, by reference (the caller's batch),
    not encoded. ``compact_relu``: codes only for the positive elements of a ReLU output."""

    def __init__(self, name=None, layers=compress.LAYER_KINDS, reuse_relu_mask: bool = False,
                 backend: str = "auto", fuse_bn_relu: bool = False, keep_input: bool = False,
                 compact_relu: bool = False, fuse_residual: bool = False, gelu_bits: int = 0):
        super().__init__(name)
        self.layers = compress.check_layer_kinds(layers)
        self.backend = backend
        self.policy = compress.SavePolicy(self.choose, self.layers, reuse_relu_mask, backend, fuse_bn_relu,
                                          keep_input, compact_relu, fuse_residual, gelu_bits)

    @abstractmethod
    def choose(self, kind: str, x: torch.Tensor, split=None):
        """The packed copy that keeps ``x`` (saved by a layer of ``kind``) for backward; ``split`` is an exact
        mask over ``x`` that backward holds anyway (a codec may use it for two ranges, or ignore it)."""

    def prepare(self, model: nn.Module) -> nn.Module:
        self.token_grid = token_grid(model)
        self.covered = compress.install(model, self.policy)
        return model

    def remove(self, model: nn.Module) -> nn.Module:
        compress.remove(model)
        self.covered = []
        self.saved_tensor_route = None
        return model

    def traced_codec(self):
        """This method's codec as plain tensor operations the compiled graph can hold
        (compress.graph_hooks.TracedCodec), or None where it has none."""
        return None

    def compile_route(self, model: nn.Module) -> nn.Module:
        """Ready ``model`` for torch.compile: its own layers back (no autograd functions for Dynamo to break
        at), and what the compiled graph saves encoded by saved-tensor hooks. Where the method has a traced
        codec and torch can inline hooks, the codec runs inside the compiled graphs (compress/graph_hooks.py);
        otherwise the hooks run the method's codec after the compiled forward (compress/saved_hooks.py).
        ``fuse_bn_relu`` applies (graph_hooks.ExactReluMasks); the other per-layer options (compact ReLU codes,
        a byte budget's plan, gelu_bits) do not; the run's notes say so for gelu_bits."""
        from division import kernels
        from division.compress import graph_hooks
        from division.compress.saved_hooks import SavedTensorCodec
        from division.memory import parameter_storages
        self.remove(model)
        codec = self.traced_codec()
        if codec is not None and graph_hooks.inlining_supported():
            on_cpu = all(p.device.type == "cpu" for p in model.parameters())
            if on_cpu and codec.kind == "division" and codec.kernels and kernels.available():
                # channels-last, as Inductor lays out a CPU graph's convolutions: the traced graph then saves
                # maps in that order, which the kernel's channels-last operators keep without copies (ActNN's
                # groups run along NCHW order: its traced codec would copy every map, so its model stays NCHW)
                model.to(memory_format=torch.channels_last)
            self.saved_tensor_route = graph_hooks.GraphCodecHooks(codec, keep_layouts=on_cpu)
            note = ("compiled: the codec runs inside the compiled graphs (saved-tensor hooks inlined by "
                    "AOTAutograd): encode at the forward's end, decode at the backward's start")
        else:
            self.saved_tensor_route = SavedTensorCodec(lambda x: self.choose("conv", x),
                                                       exclude=parameter_storages(model))
            note = ("compiled: the compiled graph's saved maps are encoded through saved-tensor hooks; they are "
                    "decoded together when its backward starts (PyTorch issue 148222)")
        if self.policy.gelu is not None:
            note += f"; gelu_bits={self.policy.gelu.bits} does not apply (a GELU's input is encoded as any map)"
        self.notes = [n for n in self.notes if not n.startswith("compiled:")] + [note]
        return model

    def policy_records(self):
        return self.policy.records

    def ids(self):
        return self.policy.ids


def token_grid(model: nn.Module):
    """(prefix tokens, (gh, gw)) of a timm-style ViT, else None."""
    patch = getattr(model, "patch_embed", None)
    grid = getattr(patch, "grid_size", None)
    if grid is None:
        return None
    return int(getattr(model, "num_prefix_tokens", 1)), (int(grid[0]), int(grid[1]))


class Division(PolicyMethod):
    """DIVISION: block-average LFC in bf16 plus a b-bit per-(sample, channel) HFC. With ``lfc=False`` it is
    the plain per-channel quantizer at the same bits (the ablation that asks what the LFC buys).

    Per-layer policy (beyond the paper): maps of at most ``small_map_elems`` elements (7x7 and 14x14 with
    256) go to ActNN-style groups of ``small_map_group`` elements, where DIVISION's per-map statistics and
    LFC cost most per element; 0 turns it off. ``single_block_lfc=False`` (beyond the paper) holds no LFC for
    maps one block covers: that LFC is the map's mean, which the per-map minimum absorbs anyway, so the codes
    and the decode are those of the same quantizer without it, 16 bits per map fewer."""

    name = "division"

    def __init__(self, name=None, block_size: int = 8, hfc_bits: int = 2, lfc_dtype: str = "bf16",
                 min_numel: int = 0, lfc: bool = True, reuse_relu_mask: bool = False,
                 layers=compress.LAYER_KINDS, stochastic: bool = True, backend: str = "auto",
                 fuse_bn_relu: bool = False, stat_dtype: str = "fp32", small_map_elems: int = 0,
                 small_map_group: int = 256, keep_input: bool = False, single_block_lfc: bool = True,
                 compact_relu: bool = False, budget=None, budget_refresh: int = 0, budget_probe: bool = True,
                 budget_groups: bool = True, fuse_residual: bool = False, budget_residual: bool = True,
                 gelu_bits: int = 0):
        if not isinstance(single_block_lfc, bool):
            raise ValueError(f"single_block_lfc={single_block_lfc!r} is invalid; valid choices: [True, False]")
        plain = PerChannelCodec(hfc_bits, stochastic, min_numel, backend, stat_dtype)
        self.codec = DivisionCodec(block_size, hfc_bits, lfc_dtype, min_numel, stochastic, backend, stat_dtype) \
            if lfc else plain
        self.one_block_codec = self.codec if single_block_lfc else plain
        self.block_size = block_size
        if isinstance(small_map_elems, bool) or not isinstance(small_map_elems, int) or small_map_elems < 0:
            raise ValueError(f"small_map_elems={small_map_elems!r} is invalid; it must be an integer >= 0 (0: off)")
        self.small_map_elems = small_map_elems
        self.small_codec = GroupwiseCodec(hfc_bits, small_map_group, stochastic, backend, stat_dtype)
        super().__init__(name, layers, reuse_relu_mask, backend, fuse_bn_relu, keep_input, compact_relu,
                         fuse_residual, gelu_bits)
        self.notes = ["maps with 1x1 spatial size, fewer than min_numel elements, and 2-D inputs are held in "
                      "bf16; token tensors use the patch grid (prefix tokens in bf16) or pool along tokens"]
        self._init_budget(budget, budget_refresh, lfc_dtype, min_numel, stochastic, backend, stat_dtype,
                          single_block_lfc, budget_probe, budget_groups, budget_residual)

    # --- method.budget: per-layer precision under a byte budget (division/budget.py) -------------------------
    def _init_budget(self, budget, refresh, lfc_dtype, min_numel, stochastic, backend, stat_dtype, single_block_lfc,
                     budget_probe=True, budget_groups=True, budget_residual=True):
        from division import budget as budget_lib
        self.budget = None if budget in (None, "", "null") else budget_lib.parse_budget(budget)
        for key, value in (("budget_probe", budget_probe), ("budget_groups", budget_groups),
                           ("budget_residual", budget_residual)):
            if not isinstance(value, bool):
                raise ValueError(f"{key}={value!r} is invalid; valid choices: [True, False]")
        if isinstance(refresh, bool) or not isinstance(refresh, int) or refresh < 0:
            raise ValueError(f"budget_refresh={refresh!r} is invalid; it must be an integer >= 0 (steps; 0: plan once)")
        self.budget_text, self.budget_refresh = budget, refresh
        self.plan, self._observer, self._fp_bytes, self._outside_bytes, self._forwards = None, None, None, 0, 0
        self.budget_probe, self._sensitivity = budget_probe, {}
        make_groups = (lambda bits, group: GroupwiseCodec(bits, group, stochastic, backend, stat_dtype)) \
            if budget_groups else None
        self._candidates = lambda h, w: budget_lib.candidate_codecs(
            lambda bits, block: DivisionCodec(block, bits, lfc_dtype, min_numel, stochastic, backend, stat_dtype),
            lambda bits: PerChannelCodec(bits, stochastic, min_numel, backend, stat_dtype), single_block_lfc, h, w,
            make_groups)
        if self.budget is not None:
            self.policy.on_begin = self._on_forward
            self.policy.compact_relu = True  # fewer bytes at the same error: the better choice at every site
            # residual blocks' outputs rebuilt (with fuse_bn_relu): their codes' bytes go to other layers
            self.policy.fuse_residual = self.policy.fuse_residual or (budget_residual and self.policy.fuse_bn_relu)
            self.notes.append(f"method.budget={budget}: each 4-D activation's HFC bits and block size (or groups, "
                              "a bf16 copy, or the activation held exactly) chosen per layer to fit the budget "
                              "(method_info.budget_plan); ReLU outputs' codes compacted to their positive elements")

    def _on_forward(self, training: bool):
        """Before each training forward: plan from the step observed last (its backward is done), and observe
        this one every ``budget_refresh`` steps."""
        if not training:
            return
        if self._observer is not None and self._observer.forwards >= 1:
            self._finish_plan(self.policy.records)
        elif self._observer is not None:
            self._observer.forwards += 1
        self._forwards += 1
        if self.budget_refresh and self.plan is not None and self._forwards % self.budget_refresh == 0:
            from division.budget import BudgetObserver
            self._observer = BudgetObserver(self._model)
            self._observer.forwards = 1

    def plan_state(self) -> Optional[dict]:
        """The plan's choices (site key -> option name) for a checkpoint, or None without a plan."""
        if self.plan is None:
            return None
        return {"choices": {k: self.plan.option(k).name for k in self.plan.choices}}

    def _finish_plan(self, records, chosen=None):
        from division.budget import make_plan
        observer, self._observer = self._observer, None
        observer.close()
        for key, site in observer.sites.items():  # measured before training; a refresh keeps them
            measured = self._sensitivity.get(key)
            # all zero where no weight gradient depends on the site in that step (a residual branch whose last
            # batch norm starts at zero): the estimate from norms then, so that such sites still get bytes
            site.sensitivities = measured if measured and any(measured) else None
        self.plan = make_plan(observer, records, self.budget, self._fp_bytes, self._outside_bytes, chosen)

    def calibrate(self, model: nn.Module, run_forward, plan_state: Optional[dict] = None):
        """With ``method.budget``: observe one training step of ``run_forward`` (forward and backward, no
        update; batch-norm statistics, random state and gradients left as they were) and plan each layer's
        precision for the budget. A budget below the cheapest plan is an error naming the least feasible one.
        ``plan_state`` (:meth:`plan_state` of a checkpoint): that plan's choices are taken back instead (no
        probe), so that a resumed run goes on as the one that was never stopped (with ``budget_refresh``, the
        next re-plan then comes ``budget_refresh`` steps after the resume)."""
        if self.budget is None:
            return None
        from division.budget import BudgetObserver, probe_sensitivities
        from division.methods.base import frozen_batchnorm_stats
        self._fp_bytes = self.fp_reference(model, run_forward).act_bytes
        devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
        grads = {p: p.grad for p in model.parameters()}
        self._observer = BudgetObserver(model)
        was_training = model.training
        model.train()
        try:
            with torch.random.fork_rng(devices=devices), frozen_batchnorm_stats(model):
                for p in model.parameters():
                    p.grad = None
                with self.accounting(model) as acc:
                    _, loss = run_forward()
                loss.backward()
                del loss
                self._observer.close()
                records, fused = list(self.policy.records), dict(self.policy.fused)
                residual = dict(self.policy.residual)
                if self.budget_probe and plan_state is None:
                    start = time.perf_counter()
                    with self.bypassed():
                        self._sensitivity = probe_sensitivities(model, run_forward, self._observer.sites, fused,
                                                                residual)
                    self._observer.seconds += time.perf_counter() - start
            records_total = sum({k: n for r in records for k, n in r.held}.values())
            self._outside_bytes = max(0, acc.report.held_bytes - records_total)
            self._finish_plan(records, None if plan_state is None else plan_state["choices"])
        finally:
            if self._observer is not None:
                self._observer.close()
                self._observer = None
            for p, g in grads.items():
                p.grad = g
            model.train(was_training)
        return self.plan

    def prepare(self, model: nn.Module) -> nn.Module:
        self._model = model
        return super().prepare(model)

    def describe(self) -> dict:
        out = super().describe()
        if self.budget is not None:
            out["budget"] = self.budget_text
            out["budget_plan"] = None if self.plan is None else self.plan.describe()
        return out

    def traced_codec(self):
        from division.compress.graph_hooks import TracedCodec
        if not isinstance(self.codec, DivisionCodec):
            return None  # the per-channel ablation: the runtime hooks
        c = self.codec
        return TracedCodec("division", c.hfc_bits, block=c.block_size, lfc_dtype=c.lfc_dtype, stochastic=c.stochastic,
                           kernels=self.backend != "reference", exact_relu_masks=self.policy.fuse_bn_relu)

    def _map_codec(self, height: int, width: int):
        return self.one_block_codec if height <= self.block_size and width <= self.block_size else self.codec

    def choose(self, kind, x, split=None, layer=None, compact=None):
        """``compact``: the ReLU mask the policy compacts this output's codes with afterwards (compact_relu), so
        that a budget measures each candidate's bytes as held."""
        if self.budget is not None and x.dim() == 4 and layer is not None:
            from division.budget import site_key
            if self._observer is not None:
                finish = None if compact is None else partial(compact_relu, mask=compact, backend=self.backend)
                self._observer.observe(layer, kind, x, self._candidates(x.shape[2], x.shape[3]), split, finish)
            option = None if self.plan is None else self.plan.option(site_key(layer, kind))
            if option is not None:
                return option.codec.encode(x, split)
        if x.dim() == 4:
            if 1 < x.shape[2] * x.shape[3] <= self.small_map_elems and x.numel() >= self.codec.min_numel:
                return self.small_codec.encode(x, split)
            return self._map_codec(x.shape[2], x.shape[3]).encode(x, split)
        if x.dim() == 3:
            prefix, grid = self.token_grid if self.token_grid else (0, None)
            hw = grid if on_grid(x.shape[1], prefix, grid) else (x.shape[1], 1)
            return encode_tokens(self._map_codec(*hw), x, prefix, grid)
        return Bf16Copy.encode(x)


class ActNN(PolicyMethod):
    """ActNN's L2 level: groups of ``group_size`` contiguous elements per sample, per-group range."""

    name = "actnn"

    def __init__(self, name=None, bits: int = 2, group_size: int = 256, layers=compress.LAYER_KINDS,
                 stochastic: bool = True, backend: str = "auto", fuse_bn_relu: bool = False,
                 keep_input: bool = False, compact_relu: bool = False, gelu_bits: int = 0):
        self.codec = GroupwiseCodec(bits, group_size, stochastic, backend)
        super().__init__(name, layers, backend=backend, fuse_bn_relu=fuse_bn_relu, keep_input=keep_input,
                         compact_relu=compact_relu, gelu_bits=gelu_bits)

    def choose(self, kind, x, split=None):
        return self.codec.encode(x, split)

    def traced_codec(self):
        from division.compress.graph_hooks import TracedCodec
        return TracedCodec("groups", self.codec.bits, group=self.codec.group_size, stochastic=self.codec.stochastic,
                           kernels=self.backend != "reference", exact_relu_masks=self.policy.fuse_bn_relu)


class Blpa(PolicyMethod):
    """BLPA: exact forward, K-bit copies with one scale per layer for backward (see BlpaCodec)."""

    name = "blpa"

    def __init__(self, name=None, bits: int = 4, layers=compress.LAYER_KINDS, stochastic: bool = False,
                 backend: str = "auto", fuse_bn_relu: bool = False, keep_input: bool = False):
        self.codec = BlpaCodec(bits, stochastic, backend)
        super().__init__(name, layers, backend=backend, fuse_bn_relu=fuse_bn_relu, keep_input=keep_input)

    def choose(self, kind, x, split=None):
        return self.codec.encode(x)


class Mesa(PolicyMethod):
    """Mesa-style 8-bit activations (Pan et al., 2021): one range per channel, round to nearest. Mesa also
    quantizes attention maps per head; with fused scaled-dot-product attention no attention map exists, and
    what the fused kernel saves (q, k, v, output, log-sum-exp) stays in full precision, as the report shows."""

    name = "mesa"

    def __init__(self, name=None, bits: int = 8, layers=compress.LAYER_KINDS, stochastic: bool = False,
                 backend: str = "auto", fuse_bn_relu: bool = False, keep_input: bool = False):
        self.codec = ChannelCodec(bits, stochastic, backend)
        super().__init__(name, layers, backend=backend, fuse_bn_relu=fuse_bn_relu, keep_input=keep_input)

    def choose(self, kind, x, split=None):
        return self.codec.encode(x)
