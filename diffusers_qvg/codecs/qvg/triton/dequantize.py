"""Decode QVG segments into a caller's workspace near the memory roofline: keys (RoPE-rotated) and values in one launch.

Work split. ``SegmentTable.tiles`` (built on the host with the table) lists the written tokens as disjoint
tiles of at most ``TILE_TOKENS``, later rows already winning, so a program reads its tile's
``(src, dst, tokens, slot)`` once: no table search, and no program for a token no segment writes. Grid:
(heads, tiles, batch x roles), heads fastest (the programs that share a token's code, scale and id sectors run
together); role 0 decodes the keys, role 1 the values of a pair launch.

Per program, blocks of ``BLOCK_T`` tokens x ``D`` channels; each thread holds runs of ``RUN`` consecutive
channels (one 16-byte store of bf16), so everything a run shares is done once per run: its code bytes (a
window of ``WINDOW`` bytes read once), its group's scale, its token's centroid id and row. Offsets inside the
tile are int32 from 64-bit per-program bases, computed once per program; a tile's last block is shifted back
to end at its last token (rewriting identical values), so only tiles shorter than a block need masks.

Ternary codes (5 per byte, base 3): the window's bytes ``b0 b1 b2`` become one 32-bit fixed-point fraction
``f ~ (b0*243^2 + b1*243 + b2) / 243^3`` (a few integer multiplies, exact for every valid byte: see
``_trit_levels``), and each digit, in order, is the integer part of ``3 * fraction``: one 32x32->64-bit
multiply per channel gives the digit (as float bits of 2^23 + 2^22 + digit) and the rest of the fraction.

The arithmetic is :mod:`..format`'s, in its order, with exact conversions from :mod:`.numerics`. Fused
multiply-adds are used only where the product is exact (level x step, centroid x power-of-two scale), so they
round exactly as the reference's separate product and sum; everything else compiles with
``enable_fp_fusion=False``. The output is bit-identical to :func:`..decode.dequantize_into` for storage the
encoder writes (codes below 243, finite values below 2^50).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....rotary import Rotary, rotary_tensors
from ...base import INT32_MAX, SegmentTable
from ...window_tiles import check_window_call, one_launch_fits, rope_operands, tile_program
from ..format import QVGPacked
from . import INTERPRETING, centroid_scale_operand
from .numerics import cast_exact

# Tokens per block: on sm_90, 8 channels x 2 tokens per thread (4 warps), 48 registers, 10 CTAs per SM; the
# interpreter, where only the per-block overhead counts, takes bigger blocks (the same code path).
BLOCK_T = 32 if INTERPRETING else 16
NUM_WARPS = 4
MAGIC = tl.constexpr(0x4B400000)  # float bits of 2^23 + 2^22: adding an integer u < 2^22 gives the float 12582912 + u


@triton.jit
def _trit(y, level0):
    """Read one base-3 digit off the 32-bit fraction ``y``: ``(float(digit) - level0 + 12582912, rest)``.

    ``y * 3 + 1`` (the +1 keeps LLVM from splitting the 64-bit add; it stays within the error budget) has the
    digit in its high word and the remaining fraction in its low word; adding 0x4B400000 to the high word
    gives the float bits of ``12582912 + digit``, all in one multiply-add."""
    prod = y.to(tl.uint64) * 3 + 0x4B40000000000001
    return (prod >> 32).to(tl.uint32).to(tl.float32, bitcast=True) - level0, prod.to(tl.uint32)


@triton.jit
def _trit_levels(y, level0, RUN: tl.constexpr):
    """``RUN`` consecutive digits of the fraction ``y`` [BT, NRUNS] as float levels ``digit - (level0 - 12582912)``
    [BT, NRUNS, RUN]: a chain of :func:`_trit` steps, joined so that each thread keeps its run's levels."""
    BT: tl.constexpr = y.shape[0]
    NR: tl.constexpr = y.shape[1]
    a0, y = _trit(y, level0)
    if RUN == 1:
        levels = tl.reshape(a0, (BT, NR, 1))
    else:
        a1, y = _trit(y, level0)
        if RUN == 2:
            levels = tl.join(a0, a1)
        else:
            a2, y = _trit(y, level0)
            a3, y = _trit(y, level0)
            if RUN == 4:
                levels = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (BT, NR, 4))
            else:
                a4, y = _trit(y, level0)
                a5, y = _trit(y, level0)
                a6, y = _trit(y, level0)
                a7, y = _trit(y, level0)
                even = tl.join(tl.join(a0, a4), tl.join(a2, a6))
                odd = tl.join(tl.join(a1, a5), tl.join(a3, a7))
                levels = tl.reshape(tl.join(even, odd), (BT, NR, 8))
    return levels


@triton.jit
def _pow3(k):
    """3^k as uint32 for small integer tensors ``k`` (here k <= 7)."""
    p = tl.full(k.shape, 1, tl.uint32)
    for i in tl.static_range(7):
        p = tl.where(k > i, p * 3, p)
    return p


@triton.jit
def _elements(base, block_offset, offsets, ty: tl.constexpr):
    """Element pointers [BT, NRUNS, 1] of ``ty`` at byte ``offsets`` past byte pointer ``base`` (+ the block's
    element offset): a byte offset adds to a 64-bit address in two instructions, a scaled one in four."""
    size: tl.constexpr = ty.primitive_bitwidth // 8
    return ((base + block_offset * size) + offsets).to(tl.pointer_type(ty))[:, :, None]


@triton.jit
def _decode_block(
    t0, n, key, shift, pointers, offsets, strides,
    out_ty: tl.constexpr, cos_ty: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr,
    TRITS: tl.constexpr, SYMMETRIC: tl.constexpr, QMAX: tl.constexpr, STAGES: tl.constexpr,
    CENT_SCALED: tl.constexpr, CSCALE_PER_ID: tl.constexpr, ROTARY: tl.constexpr, PAIRED: tl.constexpr,
    SOFTWARE_BF16: tl.constexpr, BLOCK_T: tl.constexpr, RUN: tl.constexpr, WINDOW: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Tokens ``[t0, t0 + BLOCK_T)`` of the tile (``MASKED``: only those below ``n``). The ``*_p`` are scalar
    pointers at the tile's first token; the ``*_off`` hoisted int32 offsets [BLOCK_T, NRUNS] of each row and run
    (in bytes for the workspace and RoPE tables, whose ``*_p`` are byte pointers: see :func:`_elements`)."""
    codes_p, scales_p, zeros_p, ids_p, cent_p, cscale_p, cos_p, sin_p, out_p = pointers
    code_off, scale_off, zero_off, id_off, cent_col, cos_off, sin_off, out_off, lead_pow, sel_shift, col_ok = offsets
    (s_codes_t, s_codes_c, s_scales_t, s_zeros_t, s_ids_t, s_ids_s, s_cent_stage, s_cent_k, s_cent_d,
     s_cscale_stage, s_cscale_k, s_cos_t, s_cos_d, s_sin_t, s_sin_d, s_out_t, s_out_d) = strides
    NRUNS: tl.constexpr = D_PAD // RUN
    within = tl.arange(0, RUN)[None, None, :]
    if MASKED:
        row_ok = tl.arange(0, BLOCK_T)[:, None] < n - t0  # [BT, 1]
    else:
        row_ok = None

    # Residual levels: u - qmax (symmetric) or u, as floats.
    codes = codes_p + t0 * s_codes_t + code_off
    if TRITS:
        # f = b0*ceil(2^32/243) + b1*ceil(2^32/243^2) + b2*299 + 100 is the window's base-3 fraction times 2^32
        # plus an error in [21, 298] < 2^32/3^15: every digit read off it is exact (checked for all bytes < 243).
        f = tl.load(codes, mask=row_ok).to(tl.uint32) * 17674763
        if WINDOW >= 2:
            f = f + tl.load(codes + s_codes_c, mask=row_ok).to(tl.uint32) * 72736
        if WINDOW == 3:
            f = f + (tl.load(codes + 2 * s_codes_c, mask=row_ok).to(tl.uint32) * 299 + 100)
        level = _trit_levels(f * lead_pow, 12582912.0 + QMAX, RUN)
    else:
        word = tl.zeros([BLOCK_T, NRUNS], tl.uint32)
        for m in tl.static_range(WINDOW):
            word = word | (tl.load(codes + m * s_codes_c, mask=row_ok).to(tl.uint32) << (8 * m))
        bits = ((word[:, :, None] >> sel_shift) & ((1 << BITS) - 1)) + MAGIC
        level = bits.to(tl.float32, bitcast=True) - (12582912.0 + (QMAX if SYMMETRIC else 0))
    step = tl.load(scales_p + t0 * s_scales_t + scale_off, mask=row_ok).to(tl.float32) * shift

    # Centroids, summed from 0.0 stage by stage: fma(term, power-of-two scale, sum) == sum + term * scale.
    c = tl.zeros([BLOCK_T, NRUNS, RUN], tl.float32)
    row_ok3 = row_ok[:, :, None] if MASKED else None
    for st in tl.static_range(STAGES):
        ids = tl.load(ids_p + t0 * s_ids_t + st * s_ids_s + id_off, mask=row_ok).to(tl.int32)
        rows = cent_p + st * s_cent_stage + (ids * s_cent_k + cent_col)
        term = tl.load(rows[:, :, None] + within * s_cent_d, mask=row_ok3).to(tl.float32)
        if CENT_SCALED:
            if CSCALE_PER_ID:
                scale = tl.load(cscale_p + st * s_cscale_stage + ids * s_cscale_k, mask=row_ok)[:, :, None]
            else:
                scale = tl.load(cscale_p + st * s_cscale_stage)
            c = tl.fma(term, scale, c)
        else:
            c = c + term

    # x = level * step (+ zero * shift) + c, each product exact, so one rounding per sum as in the reference.
    if SYMMETRIC:
        x = tl.fma(level, step[:, :, None], c)
    else:
        zero = tl.load(zeros_p + t0 * s_zeros_t + zero_off, mask=row_ok).to(tl.float32) * shift
        x = tl.fma(level, step[:, :, None], zero[:, :, None]) + c

    if ROTARY:  # Wan's interleaved pairs: (x1 cos - x2 sin, x1 sin + x2 cos), cos at even and sin at odd channels
        if key:
            cos = tl.load(_elements(cos_p, t0 * s_cos_t, cos_off, cos_ty) + within * s_cos_d, mask=row_ok3)
            if PAIRED:
                sin = cos
            else:
                sin = tl.load(_elements(sin_p, t0 * s_sin_t, sin_off, cos_ty) + within * s_sin_d, mask=row_ok3)
            PAIRS: tl.constexpr = (BLOCK_T, NRUNS, RUN // 2, 2) if RUN > 1 else (BLOCK_T, NRUNS // 2, 2)
            x1, x2 = tl.split(tl.reshape(x, PAIRS))
            c_even, _ = tl.split(tl.reshape(cos, PAIRS))
            _, s_odd = tl.split(tl.reshape(sin, PAIRS))
            x = tl.reshape(tl.join(x1 * c_even - x2 * s_odd, x1 * s_odd + x2 * c_even), (BLOCK_T, NRUNS, RUN))

    if MASKED:
        ok = row_ok3 & col_ok if D_PAD > D else row_ok3
    else:
        ok = col_ok if D_PAD > D else None
    out = _elements(out_p, t0 * s_out_t, out_off, out_ty) + within * s_out_d
    tl.store(out, cast_exact(x, out_ty, SOFTWARE_BF16), mask=ok)


@triton.jit
def _window_kernel(
    tiles_ptr, cos_ptr, sin_ptr,
    k_out, k_codes, k_scales, k_zeros, k_ids, k_cent, k_cscale, k_shift,
    v_out, v_codes, v_scales, v_zeros, v_ids, v_cent, v_cscale, v_shift,
    s_out_b, s_out_t, s_out_h, s_out_d,
    s_codes_b, s_codes_t, s_codes_h, s_codes_c,
    s_scales_b, s_scales_t, s_scales_h, s_scales_g,
    s_zeros_b, s_zeros_t, s_zeros_h, s_zeros_g,
    s_ids_b, s_ids_t, s_ids_h, s_ids_s,
    s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
    s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k,
    s_shift_slot, s_shift_b, s_shift_h,
    s_cos_t, s_cos_d, s_sin_t, s_sin_d,
    D: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, GROUP_BYTES: tl.constexpr, BITS: tl.constexpr,
    TRITS: tl.constexpr, SYMMETRIC: tl.constexpr, QMAX: tl.constexpr, STAGES: tl.constexpr,
    CENT_SCALED: tl.constexpr, CSCALE_PER_ID: tl.constexpr, ROTARY: tl.constexpr, PAIRED: tl.constexpr,
    ROLES: tl.constexpr, SOFTWARE_BF16: tl.constexpr, BLOCK_T: tl.constexpr, RUN: tl.constexpr,
    WINDOW: tl.constexpr,
):
    h, b, key, src, dst, n, slot = tile_program(tiles_ptr, ROLES)  # key: role 0 (rotated), else the values

    # 64-bit bases at the tile's first token, once per program.
    out_p = tl.where(key, k_out, v_out) + (b * s_out_b + dst * s_out_t + h * s_out_h)
    codes_p = tl.where(key, k_codes, v_codes) + (b * s_codes_b + src * s_codes_t + h * s_codes_h)
    scales_p = tl.where(key, k_scales, v_scales) + (b * s_scales_b + src * s_scales_t + h * s_scales_h)
    zeros_p = tl.where(key, k_zeros, v_zeros) + (b * s_zeros_b + src * s_zeros_t + h * s_zeros_h)
    ids_p = tl.where(key, k_ids, v_ids) + (b * s_ids_b + src * s_ids_t + h * s_ids_h)
    cent_p = tl.where(key, k_cent, v_cent) + (slot * s_cent_slot + b * s_cent_b + h * s_cent_h)
    cscale_p = tl.where(key, k_cscale, v_cscale) + (slot * s_cscale_slot + b * s_cscale_b + h * s_cscale_h)
    shift = tl.load(tl.where(key, k_shift, v_shift) + (slot * s_shift_slot + b * s_shift_b + h * s_shift_h))
    cos_p = cos_ptr + dst * s_cos_t
    sin_p = sin_ptr + dst * s_sin_t
    out_ty: tl.constexpr = k_out.dtype.element_ty
    cos_ty: tl.constexpr = cos_ptr.dtype.element_ty
    OUT_SIZE: tl.constexpr = out_ty.primitive_bitwidth // 8
    COS_SIZE: tl.constexpr = cos_ty.primitive_bitwidth // 8
    out_p = out_p.to(tl.pointer_type(tl.int8))
    cos_p = cos_p.to(tl.pointer_type(tl.int8))
    sin_p = sin_p.to(tl.pointer_type(tl.int8))

    # What each run needs, once per program: its code window, digit position, group, columns.
    NRUNS: tl.constexpr = D_PAD // RUN
    PER_BYTE: tl.constexpr = 5 if TRITS else 8 // BITS
    ROW_BYTES: tl.constexpr = (D // GROUP) * GROUP_BYTES
    first = tl.arange(0, NRUNS)[None, :] * RUN
    col_ok = (first < D)[:, :, None]
    if D_PAD > D:
        first = first % D  # padding runs read a real run (D_PAD < 2 D); their stores are masked
    group = first // GROUP
    byte0 = group * GROUP_BYTES + (first % GROUP) // PER_BYTE
    start = tl.minimum(byte0, ROW_BYTES - WINDOW)  # the window stays inside the token-head's code bytes
    lead = (first % GROUP) % PER_BYTE + PER_BYTE * (byte0 - start)  # digits in the window before the run's first
    if TRITS:
        lead_pow = _pow3(lead)
        sel_shift = 0
    else:
        lead_pow = 0
        digit = lead[:, :, None] + tl.arange(0, RUN)[None, None, :]
        sel_shift = (8 * (digit // PER_BYTE) + BITS * (PER_BYTE - 1 - digit % PER_BYTE)).to(tl.uint32)
    t = tl.arange(0, BLOCK_T)[:, None]
    code_off = t * s_codes_t + start * s_codes_c
    scale_off = t * s_scales_t + group * s_scales_g
    zero_off = t * s_zeros_t + group * s_zeros_g
    id_off = t * s_ids_t + first * 0
    cent_col = first * s_cent_d
    cos_off = (t * s_cos_t + first * s_cos_d) * COS_SIZE
    sin_off = (t * s_sin_t + first * s_sin_d) * COS_SIZE
    out_off = (t * s_out_t + first * s_out_d) * OUT_SIZE

    pointers = (codes_p, scales_p, zeros_p, ids_p, cent_p, cscale_p, cos_p, sin_p, out_p)
    offsets = (code_off, scale_off, zero_off, id_off, cent_col, cos_off, sin_off, out_off, lead_pow, sel_shift, col_ok)
    strides = (s_codes_t, s_codes_c, s_scales_t, s_zeros_t, s_ids_t, s_ids_s, s_cent_stage, s_cent_k, s_cent_d,
               s_cscale_stage, s_cscale_k, s_cos_t, s_cos_d, s_sin_t, s_sin_d, s_out_t, s_out_d)
    if n >= BLOCK_T:
        for t0 in range(0, n, BLOCK_T):
            _decode_block(tl.minimum(t0, n - BLOCK_T), n, key, shift, pointers, offsets, strides, out_ty, cos_ty, D,
                          D_PAD, BITS, TRITS, SYMMETRIC, QMAX, STAGES, CENT_SCALED, CSCALE_PER_ID, ROTARY, PAIRED,
                          SOFTWARE_BF16, BLOCK_T, RUN, WINDOW, False)
    else:  # a tile shorter than one block: masked rows
        _decode_block(n * 0, n, key, shift, pointers, offsets, strides, out_ty, cos_ty, D, D_PAD, BITS, TRITS,
                      SYMMETRIC, QMAX, STAGES, CENT_SCALED, CSCALE_PER_ID, ROTARY, PAIRED, SOFTWARE_BF16, BLOCK_T,
                      RUN, WINDOW, True)

def run_layout(config, head_dim: int) -> tuple[int, int]:
    """``(RUN, WINDOW)``: channels per thread run (the largest power of two <= 8 dividing the group, so a run never
    spans two groups) and the most code bytes one run reads."""
    group, per_byte = config.group_size, 5 if config.trits else 8 // config.bits
    run = min(8, group & -group)

    def byte(c: int) -> int:
        return (c // group) * config.group_code_bytes + (c % group) // per_byte

    window = max(byte(c + run - 1) - byte(c) + 1 for c in range(0, head_dim, run))
    return run, window


def _operands(storage: QVGPacked, out: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    """The kernel's pointer operands of one storage and its workspace, and their strides (zeros stand in for a
    symmetric storage's absent zero points, a dummy for absent centroid scales: neither is read)."""
    zeros = storage.zeros if storage.zeros is not None else storage.scales
    cscale, cscale_strides = centroid_scale_operand(storage)
    tensors = [out, storage.codes, storage.scales, zeros, storage.ids, storage.centroids, cscale, storage.scale_shift]
    strides = [*out.stride(), *storage.codes.stride(), *storage.scales.stride(), *zeros.stride(), *storage.ids.stride(),
               *storage.centroids.stride(), *cscale_strides, *storage.scale_shift.stride()]
    return tensors, strides


def _check_call(storage: QVGPacked, out: torch.Tensor, segments: SegmentTable, rotary: Rotary | None) -> list[torch.Tensor]:
    """What only the kernel needs (the codec's check_segments ran before); returns the rotary tensors."""
    tensors, _ = _operands(storage, out)
    rope = check_window_call(out, segments, tensors[1:5], rotary)  # codes, scales, zeros, ids
    if rotary is not None and storage.shape[-1] % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {storage.shape[-1]}")
    cent = storage.centroids  # offsets inside a head's centroid table are int32 too
    if cent.shape[-2] * cent.stride(-2) + cent.shape[-1] * cent.stride(-1) > INT32_MAX:
        raise ValueError(f"a centroid table of shape {tuple(cent.shape)} spans more than 2^31 elements per head")
    return list(rope)


def _launch(storage: QVGPacked, segments: SegmentTable, outs: list[torch.Tensor], storages: list[QVGPacked],
            rotary: Rotary | None) -> None:
    """One launch decoding ``storages`` (1: keys or values; 2: keys then values, same layout) into ``outs``."""
    cfg = storage.config
    B, _, H, D = storage.shape
    rope = (rotary_tensors(rotary) if rotary is not None else ())
    cos, sin = rope_operands(rope, outs[0])
    ops = [_operands(s, o) for s, o in zip(storages, outs)]
    k_ops, strides = ops[0]
    v_ops = ops[-1][0]
    run, window = run_layout(cfg, D)
    grid = (H, segments.tiles.shape[0], B * len(storages))
    _window_kernel[grid](
        segments.tiles, cos, sin, *k_ops, *v_ops, *strides,
        cos.stride(1), cos.stride(3), sin.stride(1), sin.stride(3),
        D=D, D_PAD=triton.next_power_of_2(D), GROUP=cfg.group_size, GROUP_BYTES=cfg.group_code_bytes, BITS=cfg.bits,
        TRITS=cfg.trits, SYMMETRIC=cfg.symmetric, QMAX=cfg.qmax, STAGES=cfg.stages,
        CENT_SCALED=storage.centroid_scales is not None,
        CSCALE_PER_ID=storage.centroid_scales is not None and storage.centroid_scales.shape[-1] != 1,
        ROTARY=rotary is not None, PAIRED=len(rope) == 1, ROLES=len(storages), SOFTWARE_BF16=INTERPRETING,
        BLOCK_T=BLOCK_T, RUN=run, WINDOW=window,
        num_warps=NUM_WARPS, enable_fp_fusion=False,
    )


def _same_layout(a: QVGPacked, a_out: torch.Tensor, b: QVGPacked, b_out: torch.Tensor) -> bool:
    """Whether two storages and workspaces can share one launch (one set of strides and constexprs)."""
    return a.config == b.config and one_launch_fits(_operands(a, a_out), _operands(b, b_out))


def dequantize_into(storage: QVGPacked, segments: SegmentTable, out: torch.Tensor, rotary: Rotary | None = None) -> None:
    """Triton twin of :func:`..decode.dequantize_into` (one launch).

    Expects a call already validated by ``QVGConfig.check_segments``; checks what only the kernel needs. The
    kernel reads the table's device tiles; the host needs nothing but their count.
    """
    _check_call(storage, out, segments, rotary)
    if len(segments.tiles) and out.shape[1]:
        _launch(storage, segments, [out], [storage], rotary)


def dequantize_pair_into(
    key_storage: QVGPacked,
    value_storage: QVGPacked,
    segments: SegmentTable,
    key_out: torch.Tensor,
    value_out: torch.Tensor,
    rotary: Rotary | None = None,
) -> None:
    """Keys (rotated by ``rotary``) and values of one table in ONE launch; storages and workspaces of different
    layouts (configs, shapes, dtypes or strides) take one launch each."""
    _check_call(key_storage, key_out, segments, rotary)
    _check_call(value_storage, value_out, segments, None)
    if not (len(segments.tiles) and key_out.shape[1]):
        return
    same = _same_layout(key_storage, key_out, value_storage, value_out)
    if same:
        _launch(key_storage, segments, [key_out, value_out], [key_storage, value_storage], rotary)
    else:
        _launch(key_storage, segments, [key_out], [key_storage], rotary)
        _launch(value_storage, segments, [value_out], [value_storage], None)
