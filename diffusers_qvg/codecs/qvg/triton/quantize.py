"""Quantize a chunk's residual to QVG codes, straight into the storage's token range (two launches).

The residual is ``x`` minus the stored centroids of every stage (ids and centroids already written to the
storage's slot), recomputed in each launch instead of materialised:

1. ``_head_extent_kernel``: each program reduces a block of one head's tokens to the head's largest scale
   need (``max |r| / qmax``, or ``max((hi - lo) / qmax, |lo|)`` asymmetric) and folds it in with an atomic
   max, which is order-independent, so the result is deterministic.
2. ``_residual_codes_kernel``: per group, the power-of-two head shift, every scale candidate rounded to
   the scale format, codes, squared error and the choice (ties to the larger scale), then packing; codes,
   scales, zeros and the slot's shift are written in place.

The arithmetic is the reference encoder's (``/work/encoder_spec.md``, :mod:`..residual`) with IEEE
divisions and exact format rounding. Only the order of the 14 error sums differs from PyTorch's, so a
group whose two best candidates tie to within float32 rounding may pick the other one (see the tests).
No host sync, no Python loop over heads; token counts are runtime arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import QVGPacked
from . import as_bits, centroid_scale_operand, check_runnable
from .centroids import stage_centroids
from .numerics import clamp, exponent, f32_to_e4m3, pow2, rint, round_to_format

BLOCK_TOKENS = 16


@triton.jit
def _residual(
    x_ptr, ids_ptr, cent_ptr, cscale_ptr, tokens, n_tokens, b, h, token_start, slot,
    s_x_b, s_x_t, s_x_h, s_x_d,
    s_ids_b, s_ids_t, s_ids_h, s_ids_s,
    s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
    s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k,
    D: tl.constexpr, D_PAD: tl.constexpr, STAGES: tl.constexpr, CENT_SCALED: tl.constexpr,
):
    """r = ((x - C_0[id_0]) - C_1[id_1]) - ... in float32 for ``tokens`` of head (b, h): [BLOCK, D_PAD]."""
    cols = tl.arange(0, D_PAD)
    row_mask = tokens < n_tokens
    mask = row_mask[:, None] & (cols < D)[None, :]
    x_rows = b * s_x_b + tokens * s_x_t + h * s_x_h
    r = tl.load(x_ptr + x_rows[:, None] + (cols * s_x_d)[None, :], mask=mask, other=0).to(tl.float32)
    stored = token_start + tokens
    id_rows = b * s_ids_b + stored * s_ids_t + h * s_ids_h
    table_rows = slot * s_cent_slot + b * s_cent_b + h * s_cent_h
    cscale_rows = slot * s_cscale_slot + b * s_cscale_b + h * s_cscale_h
    for t in tl.static_range(STAGES):
        r = r - stage_centroids(
            t, cols, mask, row_mask, id_rows, table_rows, ids_ptr, cent_ptr, cscale_ptr,
            s_ids_s, s_cent_stage, s_cent_k, s_cent_d, s_cscale_stage, s_cscale_k, cscale_rows, CENT_SCALED,
        )
    return r


@triton.jit
def _group_needs(r, BLOCK: tl.constexpr, G_PAD: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, QMAX: tl.constexpr):
    """Per group: (extent or lo, hi, the scale the group needs before the shift) as [BLOCK, G_PAD] each."""
    g = tl.reshape(r, (BLOCK, G_PAD, GROUP))
    if SYMMETRIC:
        extent = tl.max(tl.abs(g), axis=2)
        return extent, extent, tl.math.div_rn(extent, QMAX + 0.0)
    else:
        lo = tl.min(g, axis=2)
        hi = tl.max(g, axis=2)
        return lo, hi, tl.maximum(tl.math.div_rn(hi - lo, QMAX + 0.0), tl.abs(lo))


@triton.jit
def _head_extent_kernel(
    x_ptr, ids_ptr, cent_ptr, cscale_ptr, need_ptr,
    n_tokens, heads, token_start, slot,
    s_x_b, s_x_t, s_x_h, s_x_d,
    s_ids_b, s_ids_t, s_ids_h, s_ids_s,
    s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
    s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k,
    D: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, STAGES: tl.constexpr, CENT_SCALED: tl.constexpr, SYMMETRIC: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = tl.program_id(1) // heads
    h = tl.program_id(1) % heads
    r = _residual(
        x_ptr, ids_ptr, cent_ptr, cscale_ptr, tokens.to(tl.int64), n_tokens, b.to(tl.int64), h.to(tl.int64),
        token_start, slot,
        s_x_b, s_x_t, s_x_h, s_x_d, s_ids_b, s_ids_t, s_ids_h, s_ids_s,
        s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
        s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k,
        D, D_PAD, STAGES, CENT_SCALED,
    )
    G_PAD: tl.constexpr = D_PAD // GROUP
    _, _, need = _group_needs(r, BLOCK, G_PAD, GROUP, SYMMETRIC, QMAX)
    valid = (tokens < n_tokens)[:, None] & (tl.arange(0, G_PAD) * GROUP < D)[None, :]
    tl.atomic_max(need_ptr + tl.program_id(1), tl.max(tl.max(tl.where(valid, need, 0.0), axis=1), axis=0))


@triton.jit
def _pow2_at_least(v):
    """2^ceil(log2 v) for v > 0 (exponent clamped to [-126, 127]), 1 for v == 0: the reference's rule."""
    mantissa = v.to(tl.int32, bitcast=True) & 0x7FFFFF
    e = exponent(v) + tl.where(mantissa != 0, 1, 0)
    return tl.where(v > 0, pow2(tl.minimum(tl.maximum(e, -126), 127)), 1.0)


@triton.jit
def _residual_codes_kernel(
    x_ptr, ids_ptr, cent_ptr, cscale_ptr, need_ptr, alpha_ptr,
    codes_ptr, scales_ptr, zeros_ptr, shift_ptr,
    n_tokens, heads, token_start, slot,
    s_x_b, s_x_t, s_x_h, s_x_d,
    s_ids_b, s_ids_t, s_ids_h, s_ids_s,
    s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
    s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k,
    s_codes_b, s_codes_t, s_codes_h, s_codes_c,
    s_scales_b, s_scales_t, s_scales_h, s_scales_g,
    s_zeros_b, s_zeros_t, s_zeros_h, s_zeros_g,
    s_shift_slot, s_shift_b, s_shift_h,
    D: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, GROUP_BYTES: tl.constexpr, BITS: tl.constexpr,
    TRITS: tl.constexpr, SYMMETRIC: tl.constexpr, QMAX: tl.constexpr, SCALE_E4M3: tl.constexpr,
    FMT_MAX: tl.constexpr, CANDIDATES: tl.constexpr,
    STAGES: tl.constexpr, CENT_SCALED: tl.constexpr, BLOCK: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = (tl.program_id(1) // heads).to(tl.int64)
    h = (tl.program_id(1) % heads).to(tl.int64)
    tokens = tokens.to(tl.int64)
    r = _residual(
        x_ptr, ids_ptr, cent_ptr, cscale_ptr, tokens, n_tokens, b, h, token_start, slot,
        s_x_b, s_x_t, s_x_h, s_x_d, s_ids_b, s_ids_t, s_ids_h, s_ids_s,
        s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
        s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k,
        D, D_PAD, STAGES, CENT_SCALED,
    )
    G_PAD: tl.constexpr = D_PAD // GROUP
    MANTISSA: tl.constexpr = 3 if SCALE_E4M3 else 10
    MIN_EXPONENT: tl.constexpr = -6 if SCALE_E4M3 else -14
    LOW: tl.constexpr = -QMAX if SYMMETRIC else 0

    shift = _pow2_at_least(tl.math.div_rn(tl.load(need_ptr + tl.program_id(1)), FMT_MAX + 0.0))
    if tl.program_id(0) == 0:
        tl.store(shift_ptr + slot * s_shift_slot + b * s_shift_b + h * s_shift_h, shift)

    g = tl.reshape(r, (BLOCK, G_PAD, GROUP))
    lo, hi, _ = _group_needs(r, BLOCK, G_PAD, GROUP, SYMMETRIC, QMAX)
    if SYMMETRIC:
        extent = hi
        zero = tl.zeros_like(hi)
        zero_f = tl.zeros_like(hi)
    else:
        zero = round_to_format(clamp(tl.math.div_rn(lo, shift), -FMT_MAX, FMT_MAX), MANTISSA, MIN_EXPONENT)
        zero_f = zero * shift
        extent = hi - zero_f

    best_err = tl.zeros_like(hi)
    best_s = tl.zeros_like(hi)
    best_q = tl.zeros_like(g)
    for j in tl.static_range(CANDIDATES):
        alpha = tl.load(alpha_ptr + j)
        v = tl.math.div_rn(tl.math.div_rn(alpha * extent, QMAX + 0.0), shift)
        s = round_to_format(clamp(v, 0.0, FMT_MAX), MANTISSA, MIN_EXPONENT)
        step = (s * shift)[:, :, None]
        y = tl.math.div_rn(g - zero_f[:, :, None], tl.where(step > 0, step, 1.0))
        y = tl.minimum(tl.maximum(y, LOW - 1.0), QMAX + 1.0)
        q = tl.where(step > 0, tl.minimum(tl.maximum(rint(y), LOW + 0.0), QMAX + 0.0), 0.0)
        if SYMMETRIC:
            diff = g - q * step
        else:
            diff = g - (q * step + zero_f[:, :, None])
        err = tl.sum(diff * diff, axis=2)
        if j == 0:
            best_err, best_s, best_q = err, s, q
        else:
            better = err < best_err
            best_err = tl.where(better, err, best_err)
            best_s = tl.where(better, s, best_s)
            best_q = tl.where(better[:, :, None], q, best_q)

    # Stores: scales (and zeros) in the format's bits, then the packed codes byte by byte.
    groups = tl.arange(0, G_PAD)
    mask = (tokens < n_tokens)[:, None] & (groups * GROUP < D)[None, :]
    stored = token_start + tokens
    scale_at = (b * s_scales_b + stored * s_scales_t + h * s_scales_h)[:, None] + (groups * s_scales_g)[None, :]
    if SCALE_E4M3:
        tl.store(scales_ptr + scale_at, f32_to_e4m3(best_s).to(tl.uint8), mask=mask)
    else:
        tl.store(scales_ptr + scale_at, best_s.to(tl.float16), mask=mask)
    if not SYMMETRIC:
        zero_at = (b * s_zeros_b + stored * s_zeros_t + h * s_zeros_h)[:, None] + (groups * s_zeros_g)[None, :]
        if SCALE_E4M3:
            tl.store(zeros_ptr + zero_at, f32_to_e4m3(zero).to(tl.uint8), mask=mask)
        else:
            tl.store(zeros_ptr + zero_at, zero.to(tl.float16), mask=mask)

    u = best_q.to(tl.int32) - LOW
    within = tl.arange(0, GROUP)
    if TRITS:
        digit = within % 5
        weight = tl.where(digit == 0, 81, tl.where(digit == 1, 27, tl.where(digit == 2, 9, tl.where(digit == 3, 3, 1))))
        byte_of = within // 5
    else:
        weight = 1 << (BITS * (8 // BITS - 1 - within % (8 // BITS)))
        byte_of = within // (8 // BITS)
    weighted = u * weight[None, None, :]
    code_at = (b * s_codes_b + stored * s_codes_t + h * s_codes_h)[:, None] + (groups * GROUP_BYTES * s_codes_c)[None, :]
    for k in tl.static_range(GROUP_BYTES):
        byte = tl.sum(tl.where((byte_of == k)[None, None, :], weighted, 0), axis=2)
        tl.store(codes_ptr + code_at + k * s_codes_c, byte.to(tl.uint8), mask=mask)


def quantize_residual_into(
    storage: QVGPacked, x: torch.Tensor, alphas: torch.Tensor, *, token_start: int, slot: int
) -> None:
    """Write codes, scales, zeros and the slot's shift for ``x`` [B, N, H, D] into ``storage``.

    The storage must already hold this segment's ids (tokens ``[token_start, token_start + N)``) and
    centroids (``slot``); ``alphas`` (float32, on the device) are the scale fractions to try, largest first.
    """
    cfg = storage.config
    B, N, H, D = x.shape
    check_runnable(x, storage.codes, alphas)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the Triton quantizer reads bfloat16/float16/float32 input, got {x.dtype}; use the torch backend")
    if cfg.group_size & (cfg.group_size - 1):
        raise ValueError(f"the Triton quantizer needs a power-of-two group_size, got {cfg.group_size}; use the torch backend")
    if alphas.dtype != torch.float32 or alphas.dim() != 1 or len(alphas) == 0:
        raise ValueError(f"alphas must be a non-empty float32 vector, got {alphas.dtype} {tuple(alphas.shape)}")
    cscale, cscale_strides = centroid_scale_operand(storage)
    zeros = storage.zeros if storage.zeros is not None else storage.scales
    need = torch.zeros(B * H, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, BLOCK_TOKENS), B * H)
    residual_args = (
        *x.stride(), *storage.ids.stride(), *storage.centroids.stride(), *cscale_strides,
    )
    common = dict(
        D=D, D_PAD=triton.next_power_of_2(D), GROUP=cfg.group_size, STAGES=cfg.stages,
        CENT_SCALED=storage.centroid_scales is not None,
        SYMMETRIC=cfg.symmetric, QMAX=cfg.qmax, BLOCK=BLOCK_TOKENS, enable_fp_fusion=False,
    )
    inputs = (x, storage.ids, storage.centroids, cscale, need)
    _head_extent_kernel[grid](*inputs, N, H, token_start, slot, *residual_args, **common)
    _residual_codes_kernel[grid](
        *inputs, alphas, storage.codes, as_bits(storage.scales), as_bits(zeros), storage.scale_shift,
        N, H, token_start, slot, *residual_args,
        *storage.codes.stride(), *storage.scales.stride(), *zeros.stride(), *storage.scale_shift.stride(),
        GROUP_BYTES=cfg.group_code_bytes, BITS=cfg.bits, TRITS=cfg.trits, SCALE_E4M3=cfg.scale_dtype == "e4m3",
        FMT_MAX=torch.finfo(cfg.scale_torch_dtype).max, CANDIDATES=len(alphas), **common,
    )
