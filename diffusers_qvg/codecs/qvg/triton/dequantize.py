"""Dequantize every segment of a QVG storage into a caller's workspace in one launch (optionally RoPE-rotated).

Each program decodes ``BLOCK_ROWS`` (token, head) rows of the workspace for one batch entry. A row finds its
segment by scanning the segment table (later rows win, as in the reference's in-order copies), so segments
may come in any order, into any destination, and rows no segment covers are left untouched. The segment
count and all token counts are runtime arguments: a new window length never recompiles.

The arithmetic is :mod:`..format`'s, in its order, with exact conversions from :mod:`.numerics`; with
``enable_fp_fusion=False`` the RoPE products are rounded as PyTorch rounds them, so the output is
bit-identical to :func:`..decode.dequantize_into`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import QVGPacked
from . import as_bits, centroid_scale_operand, check_runnable
from .numerics import cast_exact, load_f32

BLOCK_ROWS = 32


@triton.jit
def _decode_columns(
    cols, row_mask, b, src, h, slot,
    codes_ptr, scales_ptr, zeros_ptr, ids_ptr, cent_ptr, cscale_ptr, shift_ptr,
    s_codes_b, s_codes_t, s_codes_h, s_codes_c,
    s_scales_b, s_scales_t, s_scales_h, s_scales_g,
    s_zeros_b, s_zeros_t, s_zeros_h, s_zeros_g,
    s_ids_b, s_ids_t, s_ids_h, s_ids_s,
    s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
    s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k,
    s_shift_slot, s_shift_b, s_shift_h,
    D: tl.constexpr, GROUP: tl.constexpr, GROUP_BYTES: tl.constexpr, BITS: tl.constexpr, TRITS: tl.constexpr,
    SYMMETRIC: tl.constexpr, QMAX: tl.constexpr, SCALE_E4M3: tl.constexpr, STAGES: tl.constexpr,
    CENT_E4M3: tl.constexpr, CENT_SCALED: tl.constexpr,
):
    """Decode channels ``cols`` of rows (b, src, h, slot) to float32 [rows, len(cols)]."""
    mask = row_mask[:, None] & (cols < D)[None, :]
    group = cols // GROUP
    within = cols % GROUP
    if TRITS:
        digit = within % 5
        byte_index = group * GROUP_BYTES + within // 5
    else:
        digit = within % (8 // BITS)
        byte_index = group * GROUP_BYTES + within // (8 // BITS)

    code_rows = b * s_codes_b + src * s_codes_t + h * s_codes_h
    byte = tl.load(codes_ptr + code_rows[:, None] + (byte_index * s_codes_c)[None, :], mask=mask, other=0)
    byte = byte.to(tl.int32)
    if TRITS:
        # byte // 3^(4 - digit) as a multiply and shift: ceil(2^16 / 3^k) is exact for every byte.
        magic = tl.where(digit == 0, 810, tl.where(digit == 1, 2428, tl.where(digit == 2, 7282, tl.where(digit == 3, 21846, 65536))))
        u = ((byte * magic[None, :]) >> 16) % 3
    else:
        u = (byte >> (BITS * (8 // BITS - 1 - digit))[None, :]) & ((1 << BITS) - 1)
    if SYMMETRIC:
        level = (u - QMAX).to(tl.float32)
    else:
        level = u.to(tl.float32)

    shift = tl.load(shift_ptr + slot * s_shift_slot + b * s_shift_b + h * s_shift_h, mask=row_mask, other=0)[:, None]
    scale_rows = b * s_scales_b + src * s_scales_t + h * s_scales_h
    scale = load_f32(scales_ptr, scale_rows[:, None] + (group * s_scales_g)[None, :], mask, SCALE_E4M3)
    r = level * (scale * shift)
    if not SYMMETRIC:
        zero_rows = b * s_zeros_b + src * s_zeros_t + h * s_zeros_h
        zero = load_f32(zeros_ptr, zero_rows[:, None] + (group * s_zeros_g)[None, :], mask, SCALE_E4M3)
        r = r + zero * shift

    c = tl.zeros(r.shape, tl.float32)
    for t in tl.static_range(STAGES):
        ids = tl.load(ids_ptr + b * s_ids_b + src * s_ids_t + h * s_ids_h + t * s_ids_s, mask=row_mask, other=0)
        ids = ids.to(tl.int64)
        cent_rows = slot * s_cent_slot + t * s_cent_stage + b * s_cent_b + h * s_cent_h + ids * s_cent_k
        term = load_f32(cent_ptr, cent_rows[:, None] + (cols * s_cent_d)[None, :], mask, CENT_E4M3)
        if CENT_SCALED:
            cscale_rows = slot * s_cscale_slot + t * s_cscale_stage + b * s_cscale_b + h * s_cscale_h + ids * s_cscale_k
            term = term * tl.load(cscale_ptr + cscale_rows, mask=row_mask, other=0)[:, None]
        c = c + term
    return r + c


@triton.jit
def _dequantize_kernel(
    out_ptr, seg_ptr, cos_ptr, sin_ptr,
    codes_ptr, scales_ptr, zeros_ptr, ids_ptr, cent_ptr, cscale_ptr, shift_ptr,
    num_segments, num_rows, heads,
    s_out_b, s_out_t, s_out_h, s_out_d,
    s_seg_row, s_seg_col,
    s_cos_t, s_cos_d, s_sin_t, s_sin_d,
    s_codes_b, s_codes_t, s_codes_h, s_codes_c,
    s_scales_b, s_scales_t, s_scales_h, s_scales_g,
    s_zeros_b, s_zeros_t, s_zeros_h, s_zeros_g,
    s_ids_b, s_ids_t, s_ids_h, s_ids_s,
    s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
    s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k,
    s_shift_slot, s_shift_b, s_shift_h,
    D: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, GROUP_BYTES: tl.constexpr, BITS: tl.constexpr,
    TRITS: tl.constexpr, SYMMETRIC: tl.constexpr, QMAX: tl.constexpr, SCALE_E4M3: tl.constexpr,
    STAGES: tl.constexpr, CENT_E4M3: tl.constexpr, CENT_SCALED: tl.constexpr, ROTARY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = tl.program_id(1).to(tl.int64)
    dst = rows // heads
    h = (rows % heads).to(tl.int64)

    # Which segment covers each destination token (the last matching row of the table wins).
    src = tl.zeros([BLOCK], tl.int64)
    slot = tl.zeros([BLOCK], tl.int64)
    covered = tl.zeros([BLOCK], tl.int1)
    for i in range(num_segments):
        seg_src = tl.load(seg_ptr + i * s_seg_row)
        seg_len = tl.load(seg_ptr + i * s_seg_row + s_seg_col)
        seg_dst = tl.load(seg_ptr + i * s_seg_row + 2 * s_seg_col)
        seg_slot = tl.load(seg_ptr + i * s_seg_row + 3 * s_seg_col)
        inside = (dst >= seg_dst) & (dst < seg_dst + seg_len)
        src = tl.where(inside, (seg_src + dst - seg_dst).to(tl.int64), src)
        slot = tl.where(inside, seg_slot.to(tl.int64), slot)
        covered = covered | inside
    row_mask = (rows < num_rows) & covered
    dst = dst.to(tl.int64)

    if ROTARY:
        pairs = tl.arange(0, D_PAD // 2)
        even = _decode_columns(
            2 * pairs, row_mask, b, src, h, slot,
            codes_ptr, scales_ptr, zeros_ptr, ids_ptr, cent_ptr, cscale_ptr, shift_ptr,
            s_codes_b, s_codes_t, s_codes_h, s_codes_c, s_scales_b, s_scales_t, s_scales_h, s_scales_g,
            s_zeros_b, s_zeros_t, s_zeros_h, s_zeros_g, s_ids_b, s_ids_t, s_ids_h, s_ids_s,
            s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
            s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k, s_shift_slot, s_shift_b, s_shift_h,
            D, GROUP, GROUP_BYTES, BITS, TRITS, SYMMETRIC, QMAX, SCALE_E4M3, STAGES, CENT_E4M3, CENT_SCALED,
        )
        odd = _decode_columns(
            2 * pairs + 1, row_mask, b, src, h, slot,
            codes_ptr, scales_ptr, zeros_ptr, ids_ptr, cent_ptr, cscale_ptr, shift_ptr,
            s_codes_b, s_codes_t, s_codes_h, s_codes_c, s_scales_b, s_scales_t, s_scales_h, s_scales_g,
            s_zeros_b, s_zeros_t, s_zeros_h, s_zeros_g, s_ids_b, s_ids_t, s_ids_h, s_ids_s,
            s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
            s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k, s_shift_slot, s_shift_b, s_shift_h,
            D, GROUP, GROUP_BYTES, BITS, TRITS, SYMMETRIC, QMAX, SCALE_E4M3, STAGES, CENT_E4M3, CENT_SCALED,
        )
        pair_mask = row_mask[:, None] & (2 * pairs < D)[None, :]
        cos = tl.load(cos_ptr + dst[:, None] * s_cos_t + (2 * pairs * s_cos_d)[None, :], mask=pair_mask, other=0)
        sin = tl.load(sin_ptr + dst[:, None] * s_sin_t + ((2 * pairs + 1) * s_sin_d)[None, :], mask=pair_mask, other=0)
        x = tl.interleave(even * cos - odd * sin, even * sin + odd * cos)
    else:
        x = _decode_columns(
            tl.arange(0, D_PAD), row_mask, b, src, h, slot,
            codes_ptr, scales_ptr, zeros_ptr, ids_ptr, cent_ptr, cscale_ptr, shift_ptr,
            s_codes_b, s_codes_t, s_codes_h, s_codes_c, s_scales_b, s_scales_t, s_scales_h, s_scales_g,
            s_zeros_b, s_zeros_t, s_zeros_h, s_zeros_g, s_ids_b, s_ids_t, s_ids_h, s_ids_s,
            s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
            s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k, s_shift_slot, s_shift_b, s_shift_h,
            D, GROUP, GROUP_BYTES, BITS, TRITS, SYMMETRIC, QMAX, SCALE_E4M3, STAGES, CENT_E4M3, CENT_SCALED,
        )

    cols = tl.arange(0, D_PAD)
    out_rows = b * s_out_b + dst * s_out_t + h * s_out_h
    out_mask = row_mask[:, None] & (cols < D)[None, :]
    tl.store(out_ptr + out_rows[:, None] + (cols * s_out_d)[None, :], cast_exact(x, out_ptr.dtype.element_ty), mask=out_mask)


def dequantize_into(
    storage: QVGPacked,
    segments: torch.Tensor,
    out: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Triton twin of :func:`..decode.dequantize_into` (one launch per storage; K and V are two launches).

    Expects a call already validated by ``QVGConfig.check_segments``; checks what only the kernel needs.
    """
    cfg = storage.config
    B, _, H, D = storage.shape
    check_runnable(out, segments, storage.codes, *(rotary or ()))
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the Triton decoder writes bfloat16/float16/float32 workspaces, got {out.dtype}; use the torch backend")
    if rotary is not None and any(t.dtype != torch.float32 for t in rotary):
        raise ValueError("the Triton decoder rotates with float32 cos/sin (as diffusers' Wan RoPE makes them)")
    if rotary is not None and D % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {D}")
    W = out.shape[1]
    if len(segments) == 0 or W == 0:
        return
    cos, sin = rotary if rotary is not None else (out, out)
    zeros = storage.zeros if storage.zeros is not None else storage.scales
    cscale, cscale_strides = centroid_scale_operand(storage)
    num_rows = W * H
    grid = (triton.cdiv(num_rows, BLOCK_ROWS), B)
    _dequantize_kernel[grid](
        out, segments, cos, sin,
        storage.codes, as_bits(storage.scales), as_bits(zeros), storage.ids, as_bits(storage.centroids), cscale,
        storage.scale_shift,
        len(segments), num_rows, H,
        *out.stride(), *segments.stride(), cos.stride(1), cos.stride(3), sin.stride(1), sin.stride(3),
        *storage.codes.stride(), *storage.scales.stride(), *zeros.stride(), *storage.ids.stride(),
        *storage.centroids.stride(), *cscale_strides, *storage.scale_shift.stride(),
        D=D, D_PAD=triton.next_power_of_2(D), GROUP=cfg.group_size, GROUP_BYTES=cfg.group_code_bytes, BITS=cfg.bits,
        TRITS=cfg.trits, SYMMETRIC=cfg.symmetric, QMAX=cfg.qmax, SCALE_E4M3=cfg.scale_dtype == "e4m3",
        STAGES=cfg.stages, CENT_E4M3=cfg.centroid_dtype == "e4m3", CENT_SCALED=storage.centroid_scales is not None,
        ROTARY=rotary is not None, BLOCK=BLOCK_ROWS,
        enable_fp_fusion=False,
    )
