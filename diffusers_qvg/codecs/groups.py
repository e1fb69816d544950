"""Group-wise scalar quantization shared by QVG's residuals, RTN and KIVI.

Values come in groups along the last axis of ``r`` [B, X, H, G, gs]: one scale (and zero) per group. Scales
are stored in fp8-e4m3 or fp16 *relative to a per-(batch, head) power-of-two shift*, chosen so that the
largest scale of the head just fits the format: tiny inputs do not underflow and huge ones do not
saturate, and multiplying by the shift is exact. The arithmetic below is the contract the Triton
quantize kernel reproduces; :mod:`diffusers_qvg.codecs.qvg.format` gives the decoding side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

ScaleSearch = Literal["absmax", "mse", "mse-coarse"]

# Smallest and largest float32 normal exponents: every shift and centroid scale is a normal float32.
MIN_EXP, MAX_EXP = -126, 127
# The scale search's grid: alpha_j = 1 - j / step for j < count, from the absmax scale down to 0.35 of it
# ("mse": 14 candidates) or to 0.4 in steps of 0.1 ("mse-coarse": 7, half the encoder's codes arithmetic).
SCALE_GRIDS = {"absmax": (1, 1), "mse": (20, 14), "mse-coarse": (10, 7)}
# Largest input magnitude: squared distances, group ranges and every shift must stay finite in float32.
MAX_ABS_INPUT = 2.0**50


def pow2_at_least(v: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2 v)`` for ``v > 0`` and 1 where ``v == 0``, exactly (no ``log2`` rounding).

    The exponent is clamped to float32's normal range so that the result is storable as float32.
    """
    mantissa, exponent = torch.frexp(v)  # v = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp(MIN_EXP, MAX_EXP)
    power = ((exponent + 127).to(torch.int32) << 23).view(torch.float32).to(v.dtype)
    return torch.where(v > 0, power, torch.ones_like(v))


def scale_candidates(search: ScaleSearch, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The fractions ``alpha_j`` of the absmax scale that the search tries, largest first."""
    step, count = SCALE_GRIDS[search]
    return torch.tensor([1 - j / step for j in range(count)], dtype=dtype, device=device)


@dataclass
class GroupCodes:
    """What :func:`quantize_groups` stores: codes ``u``, scales (and zeros) in the format dtype, shift."""

    u: torch.Tensor  # int32 [B, X, H, G, gs], in [0, 2 * qmax] (symmetric) or [0, qmax] (asymmetric)
    scales: torch.Tensor  # [B, X, H, G] in the format dtype
    zeros: torch.Tensor | None  # [B, X, H, G] in the format dtype (asymmetric only)
    shift: torch.Tensor  # [B, H] float32 powers of two


def quantize_groups(
    r: torch.Tensor, *, bits: int, symmetric: bool, fmt: torch.dtype, search: ScaleSearch
) -> GroupCodes:
    """Quantize ``r`` [B, X, H, G, gs] (float32 or float64) in groups along the last axis.

    Symmetric codes are ``q in [-qmax, qmax]`` with ``qmax = 2^(bits-1) - 1`` (INT2: ternary), decoded as
    ``q * step``; asymmetric codes are ``q in [0, 2^bits - 1]``, decoded as ``q * step + zero``. In order:

    - extent: symmetric ``a = max|r|``; asymmetric ``lo, hi = min r + 0, max r + 0`` per group (``+ 0``: never
      -0.0);
    - ``shift = pow2_at_least(A / fmt_max)`` per (batch, head), ``A`` the head's largest ``a / qmax``
      (asymmetric: of ``max((hi - lo) / qmax, |lo|)``), so that no scale or zero saturates;
    - asymmetric: ``zero = fmt(lo / shift)``, ``zf = float(zero) * shift``, and the extent becomes ``hi - zf``;
    - for each ``alpha_j`` of :func:`scale_candidates`: ``s = fmt(clamp(alpha_j * extent / qmax / shift,
      0, fmt_max))``, ``step = float(s) * shift``, ``q = clamp(round_half_even((r - zf) / step), low, qmax)``
      (0 where ``step == 0``), ``err = sum((r - (q * step + zf))^2)``; keep the smallest error, ties to
      the smaller ``j`` (the larger scale).
    """
    f = r.dtype
    qmax = 2 ** (bits - 1) - 1 if symmetric else 2**bits - 1
    fmt_max = torch.finfo(fmt).max  # 448 for e4m3, 65504 for fp16

    if symmetric:
        extent = r.abs().amax(-1)  # the absmax a
        head_max = (extent / qmax).amax(dim=(1, 3))
    else:
        # + 0.0 turns a -0.0 extreme into +0.0: which zero a min or max of +-0 returns depends on its order,
        # which differs between backends and kernels, and so would a stored sign bit (never a value).
        lo, hi = r.amin(-1) + 0.0, r.amax(-1) + 0.0
        head_max = torch.maximum((hi - lo) / qmax, lo.abs()).amax(dim=(1, 3))
    shift = pow2_at_least(head_max / fmt_max)
    sh = shift[:, None, :, None]  # broadcast over tokens and groups

    zeros, zero_f = None, torch.zeros((), dtype=f, device=r.device)
    if not symmetric:
        zeros = (lo / sh).clamp(-fmt_max, fmt_max).to(fmt)
        zero_f = zeros.to(f) * sh
        extent = hi - zero_f

    low = -qmax if symmetric else 0
    best_err = best_q = best_s = None
    for alpha in scale_candidates(search, f, r.device):
        s = (alpha * extent / qmax / sh).clamp(0, fmt_max).to(fmt)
        step = (s.to(f) * sh).unsqueeze(-1)
        q = torch.where(step > 0, torch.round((r - zero_f.unsqueeze(-1)) / step).clamp(low, qmax), 0.0)
        err = (r - (q * step + zero_f.unsqueeze(-1))).square().sum(-1)
        if best_err is None:
            best_err, best_q, best_s = err, q, s
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_q = torch.where(better.unsqueeze(-1), q, best_q)
        best_s = torch.where(better, s, best_s)

    u = best_q.to(torch.int32) + (qmax if symmetric else 0)
    return GroupCodes(u=u, scales=best_s, zeros=zeros, shift=shift.to(torch.float32))


def dequantize_groups(
    u: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    shift: torch.Tensor,
    *,
    qmax: int,
    symmetric: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of :func:`quantize_groups` in ``dtype``: ``(u - qmax) * step`` or ``u * step + zero``.

    ``shift`` must already broadcast against ``scales``. Every product is exact, so the order of
    operations (the one :mod:`diffusers_qvg.codecs.qvg.format` specifies) fixes the result bit for bit.
    """
    level = (u - qmax if symmetric else u).to(dtype)
    shift = shift.to(dtype)
    r = level * (scales.to(dtype) * shift).unsqueeze(-1)
    if zeros is not None:
        r = r + (zeros.to(dtype) * shift).unsqueeze(-1)
    return r
