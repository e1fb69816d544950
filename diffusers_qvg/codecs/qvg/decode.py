"""Reference QVG decoder in PyTorch: the oracle for the Triton kernels, and the CPU path.

It follows the arithmetic spelled out in :mod:`.format` step by step; see there for the order.
"""

from __future__ import annotations

import torch

from ...rotary import apply_wan_rotary, compute_dtype_for
from .format import QVGPacked, unpack_codes


def decode_tokens(storage: QVGPacked, src: int, length: int, slot: int) -> torch.Tensor:
    """Decode tokens ``[src, src + length)`` of ``slot`` to the compute dtype (float32 or float64)."""
    cfg = storage.config
    B, _, H, D = storage.shape
    f = compute_dtype_for(storage.dtype)
    tokens = slice(src, src + length)

    u = unpack_codes(storage.codes[:, tokens], cfg)  # [B, n, H, G, gs]
    level = (u - cfg.qmax if cfg.symmetric else u).to(f)
    shift = storage.scale_shift[slot].to(f).view(B, 1, H, 1, 1)
    r = level * (storage.scales[:, tokens].to(f).unsqueeze(-1) * shift)
    if storage.zeros is not None:
        r = r + storage.zeros[:, tokens].to(f).unsqueeze(-1) * shift
    r = r.flatten(-2)  # [B, n, H, D]

    c = torch.zeros_like(r)
    for t in range(cfg.stages):
        table = storage.centroids[slot, t].to(f)  # [B, H, K, D]
        if storage.centroid_scales is not None:
            table = table * storage.centroid_scales[slot, t].to(f).unsqueeze(-1)
        ids = storage.ids[:, tokens, :, t].long()  # [B, n, H]
        index = ids.permute(0, 2, 1).unsqueeze(-1).expand(B, H, length, D)
        c = c + torch.gather(table, 2, index).permute(0, 2, 1, 3)
    return r + c


def dequantize_into(
    storage: QVGPacked,
    segments: torch.Tensor,
    out: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    for src, n, dst, slot in segments.tolist():
        x = decode_tokens(storage, src, n, slot)
        if rotary is not None:
            cos, sin = (t[:, dst : dst + n] for t in rotary)
            x = apply_wan_rotary(x, cos, sin)
        out[:, dst : dst + n].copy_(x)
