"""QVG's packed storage layout: the contract between the encoder, the reference decoder and the kernels.

Storage for ``T`` tokens of a ``[B, T, H, D]`` tensor, in ``S`` segment slots, ``St`` k-means stages,
``K`` centroids, ``G = D // group_size`` groups per token-head, ``Cg`` code bytes per group:

=================  ===============================  =====================================================
field              shape                            dtype
=================  ===============================  =====================================================
codes              [B, T, H, G * Cg]                uint8 (trits: base-3 digits ``u0*81+u1*27+u2*9+u3*3+u4``;
                                                    bits: MSB-first ``u0<<6|u1<<4|u2<<2|u3`` or ``u0<<4|u1``;
                                                    a group's last byte is padded with ``u = 0``)
scales             [B, T, H, G]                     float8_e4m3fn or float16
zeros              [B, T, H, G] or None             as ``scales`` (asymmetric codes only)
ids                [B, T, H, St]                    uint8 (K <= 256) or int16
centroids          [S, St, B, H, K, D]              float8_e4m3fn, bfloat16, float16 or float32
centroid_scales    [S, St, B, H, K or 1] or None    float32 powers of two (e4m3 centroids only)
scale_shift        [S, B, H]                        float32 powers of two
=================  ===============================  =====================================================

Decoding token ``n`` of a segment in slot ``s`` (fp32 arithmetic, float64 for float64 storage), in this
exact order, so that the kernels reproduce it bit for bit::

    level = u - qmax                       (symmetric)   |  level = u                  (asymmetric)
    step  = float(scales) * scale_shift[s]               # exact: shift is a power of two
    r     = level * step                                 # exact: small integer times a short mantissa
    r     = r + float(zeros) * scale_shift[s]            (asymmetric only)
    c     = sum over t = 0..St-1, in order, of float(centroids[s, t, b, h, ids[t]]) * centroid_scale
    x     = r + c                                        then (optionally RoPE-rotated) cast to dtype

Every product above is exact, so fused multiply-adds cannot change the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Packed
from .settings import QVGSettings


@dataclass
class QVGPacked(Packed):
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    ids: torch.Tensor
    centroids: torch.Tensor
    centroid_scales: torch.Tensor | None
    scale_shift: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("codes", "scales", "zeros", "ids", "centroids", "centroid_scales", "scale_shift")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


def allocate_qvg(
    config: QVGSettings,
    batch: int,
    tokens: int,
    heads: int,
    head_dim: int,
    num_slots: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> QVGPacked:
    if head_dim % config.group_size:
        raise ValueError(
            f"head_dim {head_dim} is not divisible by group_size {config.group_size}; pick a group_size that divides it"
        )
    G = head_dim // config.group_size
    St, K = config.stages, config.centroids
    B, T, H, D, S = batch, tokens, heads, head_dim, num_slots

    def empty(*shape, dtype):
        return torch.zeros(*shape, dtype=dtype, device=device)

    e4m3_centroids = config.centroid_dtype == "e4m3"
    return QVGPacked(
        config=config,
        shape=(B, T, H, D),
        dtype=dtype,
        num_slots=S,
        codes=empty(B, T, H, G * config.group_code_bytes, dtype=torch.uint8),
        scales=empty(B, T, H, G, dtype=config.scale_torch_dtype),
        zeros=None if config.symmetric else empty(B, T, H, G, dtype=config.scale_torch_dtype),
        ids=empty(B, T, H, St, dtype=config.id_dtype),
        centroids=empty(S, St, B, H, K, D, dtype=config.centroid_torch_dtype),
        centroid_scales=(
            empty(S, St, B, H, K if config.centroid_scale == "centroid" else 1, dtype=torch.float32)
            if e4m3_centroids
            else None
        ),
        scale_shift=empty(S, B, H, dtype=torch.float32),
    )


def _digit_weights(base: int, per_byte: int, device: torch.device) -> torch.Tensor:
    """Place values of the digits in one byte, most significant first: ``base^(per_byte - 1 - j)``."""
    return torch.tensor([base ** (per_byte - 1 - j) for j in range(per_byte)], dtype=torch.int32, device=device)


def pack_digits(u: torch.Tensor, base: int, per_byte: int) -> torch.Tensor:
    """Pack codes ``u`` [..., n] (ints in [0, base)) ``per_byte`` to a byte, first code most significant,
    the last byte padded with ``u = 0``: uint8 [..., ceil(n / per_byte)]. ``base = 2^bits`` gives MSB-first
    bit fields (``u0<<6|u1<<4|u2<<2|u3``), ``base = 3`` base-3 trits."""
    n = u.shape[-1]
    pad = -n % per_byte
    u = u.to(torch.int32)
    if pad:
        u = torch.cat([u, u.new_zeros(*u.shape[:-1], pad)], dim=-1)
    u = u.unflatten(-1, (-1, per_byte))
    return (u * _digit_weights(base, per_byte, u.device)).sum(-1).to(torch.uint8)


def unpack_digits(codes: torch.Tensor, base: int, per_byte: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_digits`: uint8 [..., bytes] -> int32 codes [..., n]."""
    digits = (codes.to(torch.int32).unsqueeze(-1) // _digit_weights(base, per_byte, codes.device)) % base
    return digits.flatten(-2)[..., :n]


def _digits(config: QVGSettings) -> tuple[int, int]:
    return (3, 5) if config.trits else (2**config.bits, 8 // config.bits)


def pack_codes(u: torch.Tensor, config: QVGSettings) -> torch.Tensor:
    """Pack unsigned codes ``u`` [..., G, group_size] (ints in [0, 2^bits)) to uint8 [..., G * Cg]."""
    return pack_digits(u, *_digits(config)).flatten(-2)


def unpack_codes(codes: torch.Tensor, config: QVGSettings) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 [..., G * Cg] -> int32 codes [..., G, group_size]."""
    return unpack_digits(codes.unflatten(-1, (-1, config.group_code_bytes)), *_digits(config), config.group_size)
