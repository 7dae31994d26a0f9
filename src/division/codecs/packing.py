"""Bit packing: b-bit codes (uint8, values < 2**b) into bytes, 8/b codes per byte."""
import torch

_PACKABLE = (1, 2, 4, 8)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed for ``numel`` codes of ``bits`` bits each (the analytic size)."""
    return (numel * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a uint8 tensor of codes (any shape) into a flat uint8 tensor of ``packed_nbytes`` bytes."""
    if bits not in _PACKABLE:
        raise ValueError(f"bits={bits!r} cannot be packed; valid choices: {_PACKABLE}")
    flat = codes.reshape(-1)
    if bits == 8:
        return flat
    per_byte = 8 // bits
    pad = (-flat.numel()) % per_byte
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    groups = flat.view(-1, per_byte)
    packed = groups[:, 0].clone()
    for i in range(1, per_byte):
        packed |= groups[:, i] << (bits * i)
    return packed


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a flat uint8 tensor of ``numel`` codes."""
    if bits == 8:
        return packed[:numel]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(1) >> shifts) & mask
    return codes.reshape(-1)[:numel]
