"""Wan's rotary embedding, applied exactly as diffusers' ``WanAttnProcessor`` does, in a chosen precision.

Keys may be cached *before* RoPE (they cluster far better) and rotated when read; the read path and the
stock processor must then agree bit for bit, so both call this one function.

A window's RoPE comes in two forms: diffusers' dense ``(cos, sin)`` pair, and :class:`RotaryPairs`, the same
values in half the bytes (what a cache plans once per layout and every layer's read streams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (exact tests); everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, eq=False)  # identity equality: tensors have no single truth value
class RotaryPairs:
    """Wan RoPE as one table ``[1, W, 1, D]``: each channel pair's cos at its even channel, its sin at the odd one.

    Wan's dense tables repeat every value on both channels of its pair, and the rotation reads cos only at even
    and sin only at odd channels, so this table holds every value it uses: half of ``(cos, sin)``'s bytes, and
    a decoder reads a token's rotation with the same vector loads as its channels.
    """

    table: torch.Tensor

    def __post_init__(self) -> None:
        t = self.table
        if t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != 1 or t.shape[3] % 2:
            raise ValueError(f"a RotaryPairs table has shape [1, tokens, 1, even head_dim], got {tuple(t.shape)}")

    @property
    def tokens(self) -> int:
        return self.table.shape[1]

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The values :func:`apply_wan_rotary` reads: cos of each pair, sin of each pair ([1, W, 1, D / 2] views)."""
        return self.table[..., 0::2], self.table[..., 1::2]


Rotary = Union[tuple[torch.Tensor, torch.Tensor], RotaryPairs]


def rotary_pairs(cos: torch.Tensor, sin: torch.Tensor) -> RotaryPairs:
    """The :class:`RotaryPairs` of diffusers' dense ``(cos, sin)`` [1, W, 1, D] (values copied, not recomputed)."""
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError(f"cos and sin must share shape and dtype, got {tuple(cos.shape)} {cos.dtype} and {tuple(sin.shape)} {sin.dtype}")
    table = torch.empty(cos.shape, dtype=cos.dtype, device=cos.device)
    table[..., 0::2] = cos[..., 0::2]
    table[..., 1::2] = sin[..., 1::2]
    return RotaryPairs(table)


def rotary_tensors(rotary: Rotary) -> tuple[torch.Tensor, ...]:
    """The tensors either form holds (for shape, dtype and device checks)."""
    return (rotary.table,) if isinstance(rotary, RotaryPairs) else tuple(rotary)


def rotary_slice(rotary: Rotary, start: int, stop: int) -> Rotary:
    """Tokens ``[start, stop)`` of either form, as views."""
    if isinstance(rotary, RotaryPairs):
        return RotaryPairs(rotary.table[:, start:stop])
    return tuple(t[:, start:stop] for t in rotary)


def rotate(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """:func:`apply_wan_rotary` with either form; the values, so the result, are the same."""
    if isinstance(rotary, RotaryPairs):
        return _rotate_pairs(x, *rotary.cos_sin())
    return apply_wan_rotary(x, *rotary)


def apply_wan_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, S, H, D] by Wan's interleaved-pair RoPE; ``cos``/``sin`` broadcast as [1, S, 1, D].

    The arithmetic is diffusers' own (``x1*cos - x2*sin``, ``x1*sin + x2*cos`` on channel pairs), done in
    the promoted dtype of ``x`` and ``cos`` and rounded once, as it is stored into a tensor of ``x``'s dtype
    (as diffusers stores it: no float32 buffer and no cast pass).
    """
    return _rotate_pairs(x, cos[..., 0::2], sin[..., 1::2])


def _rotate_pairs(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The rotation with each pair's cos ``c`` and sin ``s`` ([..., D / 2])."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out
