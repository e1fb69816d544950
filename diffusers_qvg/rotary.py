"""Wan's rotary embedding, applied exactly as diffusers' ``WanAttnProcessor`` does, in a chosen precision.

Keys may be cached *before* RoPE (they cluster far better) and rotated when read; the read path and the
stock processor must then agree bit for bit, so both call this one function.
"""

from __future__ import annotations

import torch


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (exact tests); everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def apply_wan_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, S, H, D] by Wan's interleaved-pair RoPE; ``cos``/``sin`` broadcast as [1, S, 1, D].

    The arithmetic is diffusers' own (``x1*cos - x2*sin``, ``x1*sin + x2*cos`` on channel pairs), done in
    the promoted dtype of ``x`` and ``cos`` and rounded once, as it is stored into a tensor of ``x``'s dtype
    (as diffusers stores it: no float32 buffer and no cast pass).
    """
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c = cos[..., 0::2]
    s = sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out
