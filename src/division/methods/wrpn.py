"""WRPN (Mishra et al., 2018, "WRPN: Wide Reduced-Precision Networks"): k-bit weights and k-bit activations
in the forward pass, trained with straight-through gradients, on a network widened to win back accuracy
(``model.width_mult``, e.g. 2).

Activations after every ReLU are clamped to [0, 1] and rounded to 2^k - 1 levels; weights are clamped to
[-1, 1] and rounded to 2^(k-1) - 1 levels per sign; the first convolution and the last linear layer keep full
precision, as in WRPN. Eval runs the same quantized network. Memory: a convolution or linear input that a
quantized ReLU produced is exactly one of 2^k levels, so backward holds it as packed k-bit codes, losslessly;
the ReLU keeps a 1-bit mask for its clamp; batch-norm inputs and other tensors are held as plain autograd
holds them (fp32). Weight gradients use the quantized weights (the STE passes them where |w| <= 1).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from division import compress
from division.codecs import FullCopy
from division.codecs.base import ieee_div, use_triton
from division.codecs.groupwise import ReshapedQuantized, parallel_rows
from division.codecs.quant import BitMask, check_bits, quantize_per_row
from division.compress.linear import _Conv2dFn, _LinearFn
from division.compress.pointwise import _ReLUFn
from division.methods.compressed import PolicyMethod


class ExactLevels:
    """Marks a tensor whose every element is i / (2^bits - 1), i = 0 .. 2^bits - 1."""

    __slots__ = ("bits",)

    def __init__(self, bits: int):
        self.bits = bits


def full_precision_layers(convs: list, linears: list) -> list:
    """Of a model's convolutions and linear layers in order (modules or names), those WRPN leaves in full
    precision: the first convolution and the last linear layer."""
    return convs[:1] + linears[-1:]


def quantize_activation(x: torch.Tensor, bits: int) -> torch.Tensor:
    levels = (1 << bits) - 1
    return ieee_div(torch.round(x.clamp(0, 1) * levels), levels)


def quantized_relu(x: torch.Tensor, bits: int, backend: str = "auto"):
    """``(quantize_activation(x), the mask 0 < x < 1 where the clamp passes the gradient)``; one pass on the CPU
    kernel or, for float32 on CUDA, the Triton kernel; both round exactly as ``quantize_activation`` does."""
    if x.dtype == torch.float32 and use_triton(x, backend):
        from division.kernels import triton_codecs
        y, packed = triton_codecs.quant_relu_mask(x, (1 << bits) - 1)
        return y, BitMask(packed, x.shape, "triton")
    lib = BitMask.one_pass_kernel(x, backend)
    if lib is None:
        return quantize_activation(x, bits), BitMask.encode((x > 0) & (x < 1))
    y = torch.empty_like(x)
    packed = BitMask.empty_packed(x.numel())
    lib.quant_relu_mask(x.data_ptr(), x.numel(), (1 << bits) - 1, y.data_ptr(), packed.data_ptr(),
                        torch.get_num_threads())
    return y, BitMask(packed, x.shape, "compiled")


def quantize_weight(w: torch.Tensor, bits: int) -> torch.Tensor:
    levels = (1 << (bits - 1)) - 1
    return torch.round(w.clamp(-1, 1) * levels) / levels


class _QuantReLUFn(_ReLUFn):
    """ReLU clamped to [0, 1] and rounded to k bits; backward (the ReLU's) passes the gradient where
    0 < x < 1 (1-bit mask)."""

    @staticmethod
    def forward(ctx, x, bits, policy, layer):
        y, ctx.mask = quantized_relu(x, bits, policy.backend)
        policy.save_mask(y, ctx.mask, "relu", layer, x.numel() * x.element_size(), policy.ids(y))
        policy.note_exact(y, ExactLevels(bits))
        return y


class _QuantWeightFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, bits):
        ctx.save_for_backward(w)  # a parameter: not an activation, never counted
        return quantize_weight(w, bits)

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad * (w.abs() <= 1).to(grad.dtype), None


def _training(m, x, policy):
    return policy.enabled and m.training and torch.is_grad_enabled() and x.is_floating_point()


class Wrpn(PolicyMethod):
    name = "wrpn"

    def __init__(self, name=None, bits: int = 4, layers=("conv", "bn", "linear", "relu", "maxpool", "dropout",
                                                          "avgpool"), backend: str = "auto"):
        self.bits = check_bits(bits)
        if self.bits == 1:
            raise ValueError("bits=1 is invalid for WRPN (signed weights need >= 2 bits); valid choices: [2, 4, 8]")
        super().__init__(name, layers, backend=backend)
        self.notes = [f"{self.bits}-bit weights and activations in forward (first conv and last linear in full "
                      "precision); quantized activations held as exact packed codes, other tensors in fp32"]

    def choose(self, kind, x, split=None):
        exact = self.policy.exact_levels(x)
        if exact is None or x.numel() == 0:
            return FullCopy(x)
        flat = x.reshape(-1)
        zero, one = torch.zeros(1, device=x.device), torch.ones(1, device=x.device)
        q = quantize_per_row(flat.view(parallel_rows(flat.numel()), -1), exact.bits, stochastic=False, minimum=zero,
                             maximum=one, backend=self.backend)
        return ReshapedQuantized(q, x.shape)

    def prepare(self, model: nn.Module) -> nn.Module:
        convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        full = {id(m) for m in full_precision_layers(convs, linears)}
        bits = self.bits

        def weight(m, training):
            if id(m) in full:
                return m.weight
            return _QuantWeightFn.apply(m.weight, bits) if training else quantize_weight(m.weight, bits)

        def conv(m, policy, name):
            def forward(self, x):
                if _training(self, x, policy) and x.dim() == 4:
                    return _Conv2dFn.apply(x, weight(self, True), self.bias, self.stride, self.padding, self.dilation,
                                           self.groups, policy, name)
                return F.conv2d(x, weight(self, False), self.bias, self.stride, self.padding, self.dilation,
                                self.groups)
            return forward

        def linear(m, policy, name):
            def forward(self, x):
                if _training(self, x, policy):
                    return _LinearFn.apply(x, weight(self, True), self.bias, policy, name)
                return F.linear(x, weight(self, False), self.bias)
            return forward

        def relu(m, policy, name):
            def forward(self, x):
                if _training(self, x, policy):
                    return _QuantReLUFn.apply(x, bits, policy, name)
                return quantize_activation(x, bits)
            return forward

        self.token_grid = None
        self.covered = compress.install(model, self.policy, routes={"conv": conv, "linear": linear, "relu": relu})
        return model
