"""Reference QVG decoder in PyTorch: the oracle for the Triton kernels, and the CPU path.

It follows the arithmetic spelled out in :mod:`.format` step by step; see there for the order.
"""

from __future__ import annotations

import torch

from ...rotary import Rotary, compute_dtype_for, rotary_slice, rotate
from ..base import SegmentTable
from ..groups import dequantize_groups
from .format import QVGPacked, unpack_codes


def decode_centroids(values: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored centroids [..., K, D] (times their power-of-two scales [..., K or 1], if any) in ``dtype``."""
    table = values.to(dtype)
    if scales is not None:
        table = table * scales.to(dtype).unsqueeze(-1)
    return table


def decode_tokens(storage: QVGPacked, src: int, length: int, slot: int) -> torch.Tensor:
    """Decode tokens ``[src, src + length)`` of ``slot`` to the compute dtype (float32 or float64)."""
    cfg = storage.config
    B, _, H, D = storage.shape
    f = compute_dtype_for(storage.dtype)
    tokens = slice(src, src + length)

    r = dequantize_groups(
        unpack_codes(storage.codes[:, tokens], cfg),  # [B, n, H, G, gs]
        storage.scales[:, tokens],
        None if storage.zeros is None else storage.zeros[:, tokens],
        storage.scale_shift[slot].view(B, 1, H, 1),
        qmax=cfg.qmax,
        symmetric=cfg.symmetric,
        dtype=f,
    ).flatten(-2)  # [B, n, H, D]

    c = torch.zeros_like(r)
    for t in range(cfg.stages):
        scales = None if storage.centroid_scales is None else storage.centroid_scales[slot, t]
        table = decode_centroids(storage.centroids[slot, t], scales, f)  # [B, H, K, D]
        ids = storage.ids[:, tokens, :, t].long()  # [B, n, H]
        index = ids.permute(0, 2, 1).unsqueeze(-1).expand(B, H, length, D)
        c = c + torch.gather(table, 2, index).permute(0, 2, 1, 3)
    return r + c


def dequantize_into(
    storage: QVGPacked,
    segments: SegmentTable,
    out: torch.Tensor,
    rotary: Rotary | None = None,
) -> None:
    """Decode each segment in turn from the table's host rows (later rows win where destinations overlap)."""
    for src, n, dst, slot in segments.rows:
        x = decode_tokens(storage, src, n, slot)
        if rotary is not None:
            x = rotate(x, rotary_slice(rotary, dst, dst + n))
        out[:, dst : dst + n].copy_(x)
