"""Dequantize every segment of a QVG storage into a caller's workspace in one launch (optionally RoPE-rotated).

Each program decodes ``BLOCK_ROWS`` (token, head) rows of the workspace for one batch entry. A row finds its
segment by scanning the segment table (later rows win, as in the reference's in-order copies), so segments
may come in any order, into any destination, and rows no segment covers are left untouched; when one
segment alone covers all of a program's tokens (nearly always), a scalar scan finds it once for all rows. The segment
count and all token counts are runtime arguments: a new window length never recompiles.

The arithmetic is :mod:`..format`'s, in its order, with exact conversions from :mod:`.numerics`; with
``enable_fp_fusion=False`` the RoPE products are rounded as PyTorch rounds them, so the output is
bit-identical to :func:`..decode.dequantize_into`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...base import SegmentTable
from ..format import QVGPacked
from . import INTERPRETING, centroid_scale_operand, check_runnable
from .centroids import stage_centroids
from .numerics import cast_exact

# 8 rows x 128 channels per program keeps the kernel at ~60 registers on sm_90 (no spills; 16 rows need 145,
# 64 rows spill); the interpreter, where only the per-program overhead counts, takes bigger tiles.
BLOCK_ROWS = 32 if INTERPRETING else 8


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
    TRITS: tl.constexpr, SYMMETRIC: tl.constexpr, QMAX: tl.constexpr, STAGES: tl.constexpr,
    CENT_SCALED: tl.constexpr, ROTARY: tl.constexpr, SOFTWARE_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = tl.program_id(1).to(tl.int64)
    dst = rows // heads
    h = (rows % heads).to(tl.int64)

    # Which segment covers each destination token (the last matching row of the table wins). Usually one
    # segment holds all of this program's tokens: a scalar scan finds it, and rows need no search of their own.
    first = (tl.program_id(0) * BLOCK) // heads
    last = (tl.minimum(tl.program_id(0) * BLOCK + BLOCK, num_rows) - 1) // heads
    hits = 0
    hit_src = 0
    hit_dst = 0
    hit_len = 0
    hit_slot = 0
    for i in range(num_segments):
        seg_src = tl.load(seg_ptr + i * s_seg_row)
        seg_len = tl.load(seg_ptr + i * s_seg_row + s_seg_col)
        seg_dst = tl.load(seg_ptr + i * s_seg_row + 2 * s_seg_col)
        seg_slot = tl.load(seg_ptr + i * s_seg_row + 3 * s_seg_col)
        hit = (seg_dst <= last) & (seg_dst + seg_len > first)
        hits += hit.to(tl.int32)
        hit_src = tl.where(hit, seg_src, hit_src)
        hit_dst = tl.where(hit, seg_dst, hit_dst)
        hit_len = tl.where(hit, seg_len, hit_len)
        hit_slot = tl.where(hit, seg_slot, hit_slot)
    if (hits == 1) & (hit_dst <= first) & (hit_dst + hit_len > last):
        src = (hit_src + dst - hit_dst).to(tl.int64)
        slot = tl.zeros([BLOCK], tl.int64) + hit_slot
        covered = tl.full([BLOCK], True, tl.int1)
    else:
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

    cols = tl.arange(0, D_PAD)
    mask = row_mask[:, None] & (cols < D)[None, :]
    group = cols // GROUP
    within = cols % GROUP
    if TRITS:
        digit = within % 5
        byte_index = group * GROUP_BYTES + within // 5
    else:
        digit = within % (8 // BITS)
        byte_index = group * GROUP_BYTES + within // (8 // BITS)

    # Residual: level * (scale * shift) (+ zero * shift), every product exact.
    code_rows = b * s_codes_b + src * s_codes_t + h * s_codes_h
    byte = tl.load(codes_ptr + code_rows[:, None] + (byte_index * s_codes_c)[None, :], mask=mask, other=0).to(tl.int32)
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
    scale = tl.load(scales_ptr + scale_rows[:, None] + (group * s_scales_g)[None, :], mask=mask).to(tl.float32)
    x = level * (scale * shift)
    if not SYMMETRIC:
        zero_rows = b * s_zeros_b + src * s_zeros_t + h * s_zeros_h
        zero = tl.load(zeros_ptr + zero_rows[:, None] + (group * s_zeros_g)[None, :], mask=mask).to(tl.float32)
        x = x + zero * shift

    # Centroids: summed from 0.0 stage by stage, then added, exactly as the reference orders it.
    c = tl.zeros([BLOCK, D_PAD], tl.float32)
    id_rows = b * s_ids_b + src * s_ids_t + h * s_ids_h
    table_rows = slot * s_cent_slot + b * s_cent_b + h * s_cent_h
    cscale_rows = slot * s_cscale_slot + b * s_cscale_b + h * s_cscale_h
    for t in tl.static_range(STAGES):
        c = c + stage_centroids(
            t, cols, mask, row_mask, id_rows, table_rows, ids_ptr, cent_ptr, cscale_ptr,
            s_ids_s, s_cent_stage, s_cent_k, s_cent_d, s_cscale_stage, s_cscale_k, cscale_rows, CENT_SCALED,
        )
    x = x + c

    if ROTARY:  # Wan's interleaved pairs: (x1 cos - x2 sin, x1 sin + x2 cos), cos at even and sin at odd channels
        cos = tl.load(cos_ptr + dst[:, None] * s_cos_t + (cols * s_cos_d)[None, :], mask=mask, other=0)
        sin = tl.load(sin_ptr + dst[:, None] * s_sin_t + (cols * s_sin_d)[None, :], mask=mask, other=0)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK, D_PAD // 2, 2)))
        c_even, _ = tl.split(tl.reshape(cos, (BLOCK, D_PAD // 2, 2)))
        _, s_odd = tl.split(tl.reshape(sin, (BLOCK, D_PAD // 2, 2)))
        x = tl.reshape(tl.join(x1 * c_even - x2 * s_odd, x1 * s_odd + x2 * c_even), (BLOCK, D_PAD))

    out_rows = b * s_out_b + dst * s_out_t + h * s_out_h
    tl.store(out_ptr + out_rows[:, None] + (cols * s_out_d)[None, :], cast_exact(x, out_ptr.dtype.element_ty, SOFTWARE_BF16), mask=mask)


def dequantize_into(
    storage: QVGPacked,
    segments: SegmentTable,
    out: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Triton twin of :func:`..decode.dequantize_into` (one launch per storage; K and V are two launches).

    Expects a call already validated by ``QVGConfig.check_segments``; checks what only the kernel needs. The
    kernel reads the table's device tensor; the host needs only its row count.
    """
    cfg = storage.config
    B, _, H, D = storage.shape
    table = segments.tensor
    check_runnable(out, table, storage.codes, *(rotary or ()))
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
        out, table, cos, sin,
        storage.codes, storage.scales, zeros, storage.ids, storage.centroids, cscale,
        storage.scale_shift,
        len(segments), num_rows, H,
        *out.stride(), *table.stride(), cos.stride(1), cos.stride(3), sin.stride(1), sin.stride(3),
        *storage.codes.stride(), *storage.scales.stride(), *zeros.stride(), *storage.ids.stride(),
        *storage.centroids.stride(), *cscale_strides, *storage.scale_shift.stride(),
        D=D, D_PAD=triton.next_power_of_2(D), GROUP=cfg.group_size, GROUP_BYTES=cfg.group_code_bytes, BITS=cfg.bits,
        TRITS=cfg.trits, SYMMETRIC=cfg.symmetric, QMAX=cfg.qmax, STAGES=cfg.stages,
        CENT_SCALED=storage.centroid_scales is not None, ROTARY=rotary is not None, SOFTWARE_BF16=INTERPRETING,
        BLOCK=BLOCK_ROWS,
        enable_fp_fusion=False,
    )
