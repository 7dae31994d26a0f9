"""Token activations (batch, tokens, channels): DIVISION on the patch grid, prefix tokens apart; and the
per-channel 8-bit codec of Mesa-style training."""
from dataclasses import dataclass
from typing import Optional

import torch

from division.codecs.base import Rearranged
from division.codecs.quant import Bf16Copy, Packed, check_backend, check_bits, quantize_per_row


@dataclass(eq=False)
class TokenPacked(Packed):
    prefix: Optional[Packed]
    body: Packed
    grid: Optional[tuple]  # (gh, gw) for a patch grid, None for a sequence pooled along tokens
    shape: torch.Size
    kind = "division"

    @property
    def backend(self) -> str:
        return self.body.backend

    def tensors(self):
        return (self.prefix.tensors() if self.prefix is not None else []) + self.body.tensors()

    def decode(self) -> torch.Tensor:
        b, t, c = self.shape
        body = self.body.decode()  # (B, C, gh, gw) or (B, C, T', 1)
        body = body.reshape(b, c, -1).transpose(1, 2)
        if self.prefix is None:
            return body.contiguous()
        return torch.cat([self.prefix.decode(), body], dim=1)


def on_grid(tokens: int, prefix_tokens: int = 0, grid: Optional[tuple] = None) -> bool:
    """Whether ``tokens`` tokens are the prefix plus a full patch grid."""
    return grid is not None and tokens == prefix_tokens + grid[0] * grid[1]


def token_body(x: torch.Tensor, prefix_tokens: int = 0, grid: Optional[tuple] = None):
    """(B, T, C) -> (the maps a codec sees, whether they lie on the patch grid): (B, C, gh, gw) of the last
    gh*gw tokens when T == prefix + gh*gw (the prefix left out), else (B, C, T, 1), every token."""
    b, t, c = x.shape
    if on_grid(t, prefix_tokens, grid):
        return x[:, prefix_tokens:].transpose(1, 2).reshape(b, c, *grid), True
    return x.transpose(1, 2).reshape(b, c, t, 1), False


def encode_tokens(codec, x: torch.Tensor, prefix_tokens: int = 0, grid: Optional[tuple] = None,
                  keep_prefix=Bf16Copy.encode) -> Packed:
    """(B, T, C): the last gh*gw tokens form a 2-D patch grid when T == prefix + gh*gw; the prefix (class,
    register tokens) is held apart by ``keep_prefix`` (in bf16). Without a grid, blocks pool along the token
    axis."""
    body, on_grid = token_body(x, prefix_tokens, grid)
    if on_grid:
        prefix = keep_prefix(x[:, :prefix_tokens].contiguous()) if prefix_tokens else None
        return TokenPacked(prefix, codec.encode(body), grid, x.shape)
    return TokenPacked(None, codec.encode(body), None, x.shape)


@dataclass(eq=False)
class ChannelQuantized(Rearranged):
    """Codes with one range per channel: rows are the channels, moved first."""

    q: Packed
    shape: torch.Size
    channel_dim: int

    def decode(self) -> torch.Tensor:
        moved = list(self.shape)
        moved.insert(0, moved.pop(self.channel_dim))
        return self.q.decode().view(moved).movedim(0, self.channel_dim).contiguous()


class ChannelCodec:
    """Mesa-style (Pan et al., 2021): 8-bit codes with one range per channel (the feature dimension of
    token tensors, dim 1 of maps), round to nearest."""

    def __init__(self, bits: int = 8, stochastic: bool = False, backend: str = "auto"):
        self.bits = check_bits(bits)
        self.stochastic = stochastic
        self.backend = check_backend(backend)

    def encode(self, x: torch.Tensor) -> Packed:
        channel_dim = 1 if x.dim() == 4 else x.dim() - 1
        rows = x.movedim(channel_dim, 0).reshape(x.shape[channel_dim], -1)
        return ChannelQuantized(quantize_per_row(rows, self.bits, self.stochastic, backend=self.backend), x.shape, channel_dim)
