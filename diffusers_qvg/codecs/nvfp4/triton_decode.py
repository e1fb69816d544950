"""Decode NVFP4 segments into a caller's workspace in one Triton launch: keys (RoPE-rotated) and values.

The work split is the QVG decoder's (``SegmentTable.tiles``, built on the host: a program reads its tile's
``(src, dst, tokens, slot)`` once, and no program runs for a token no segment writes). Grid: (heads, tiles,
batch x roles), role 0 the keys, role 1 the values of a pair launch. Per program, blocks of ``BLOCK_T`` tokens
x the head's channels; each thread holds runs of 8 channels: their 4 code bytes (one 32-bit load), their
block's e4m3 scale (one byte) and their 8 outputs (one 16-byte store of bf16). A byte's two codes are a RoPE
pair (channels ``2j`` and ``2j + 1``), so the rotation needs no shuffle, and every tensor keeps one register
layout (no shared-memory conversion; on sm_90 55 registers, 56% occupancy: docs/benchmarks.md).

The arithmetic is :func:`.format.decode_reference`'s, in its order: e2m1 values built from their bits
(exact, no select: see :func:`e2m1_float`), times ``e4m3 scale * tensor scale`` (one float32 product, as the
reference rounds it), rotated as :func:`~diffusers_qvg.rotary.rotate`, cast once; compiled without fused
multiply-adds, so the output is bit-identical to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...rotary import Rotary, rotary_tensors
from ..base import SegmentTable
from ..kernel_backend import INTERPRETING
from ..qvg.triton.numerics import cast_exact
from ..window_tiles import check_window_call, one_launch_fits, rope_operands, tile_program
from .format import NVFP4Packed

# Tokens per block: on sm_90, 16 tokens x 16 runs of 8 channels per 128 threads, 2 runs per thread (32 tokens:
# 109 registers, 25% occupancy, 2% fewer instructions; 8: 32 registers, 100%, 7% more); the interpreter, where
# only the per-block overhead counts, takes bigger blocks (the same code path).
BLOCK_T = 64 if INTERPRETING else 16
NUM_WARPS = 4


@triton.jit
def e2m1_float(magnitude_bits, sign_bits):
    """float32 values of e2m1 codes, exactly, from their bits placed as float32 fields: ``magnitude_bits`` the
    code's 3 magnitude bits at bits 22-24 (exponent ``e`` at 23-24, mantissa ``m`` at 22), ``sign_bits`` its
    sign at bit 31. That is the float ``2^(e - 127) * (1 + m / 2)``, or the subnormal ``m * 2^-127`` where
    ``e = 0``; times ``2^126``, exact, it is e2m1's ``2^(e - 1) * (1 + m / 2)``, or ``m / 2``. No select."""
    return (magnitude_bits | sign_bits).to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def _window_kernel(
    tiles_ptr, cos_ptr, sin_ptr,
    k_out, k_codes, k_scales, k_tscale,
    v_out, v_codes, v_scales, v_tscale,
    s_out_b, s_out_t, s_out_h, s_out_d,
    s_codes_b, s_codes_t, s_codes_h, s_codes_c,
    s_scales_b, s_scales_t, s_scales_h, s_scales_g,
    s_tscale_slot, s_tscale_b, s_tscale_h,
    s_cos_t, s_cos_d, s_sin_t, s_sin_d,
    NW: tl.constexpr, NW_PAD: tl.constexpr, ROTARY: tl.constexpr, PAIRED: tl.constexpr, ROLES: tl.constexpr,
    SOFTWARE_BF16: tl.constexpr, BLOCK_T: tl.constexpr,
):
    h, b, key, src, dst, n, slot = tile_program(tiles_ptr, ROLES)

    # 64-bit bases at the tile's first token, once per program; int32 offsets inside the tile.
    out_p = tl.where(key, k_out, v_out) + (b * s_out_b + dst * s_out_t + h * s_out_h)
    codes_p = tl.where(key, k_codes, v_codes) + (b * s_codes_b + src * s_codes_t + h * s_codes_h)
    scales_p = tl.where(key, k_scales, v_scales) + (b * s_scales_b + src * s_scales_t + h * s_scales_h)
    tscale = tl.load(tl.where(key, k_tscale, v_tscale) + (slot * s_tscale_slot + b * s_tscale_b + h * s_tscale_h))
    cos_p = cos_ptr + dst * s_cos_t
    sin_p = sin_ptr + dst * s_sin_t
    out_ty: tl.constexpr = k_out.dtype.element_ty

    # A thread's unit is 4 code bytes: 8 channels (channel 2j in byte j's low nibble, 2j + 1 in its high one), 4
    # RoPE pairs, one 16-byte store of bf16. Two units share a block's e4m3 scale.
    t = tl.arange(0, BLOCK_T)[:, None]
    w = tl.arange(0, NW_PAD)[None, :]
    four = tl.arange(0, 4)[None, None, :]
    eight = tl.arange(0, 8)[None, None, :]
    # Per run, 2-D [BT, NW_PAD] offsets computed once; the run's own bytes / channels are added last, as a
    # constant 0..3 / 0..7 times a unit stride, so each run costs one address.
    byte_off = t * s_codes_t + w * (4 * s_codes_c)
    scale_off = t * s_scales_t + (w // 2) * s_scales_g
    cos_off = t * s_cos_t + w * (8 * s_cos_d)
    sin_off = t * s_sin_t + w * (8 * s_sin_d)
    out_off = t * s_out_t + w * (8 * s_out_d)
    PAIRS: tl.constexpr = (BLOCK_T, NW_PAD, 4, 2)
    for t0 in range(0, n, BLOCK_T):
        ok = (t < n - t0) & (w < NW)  # [BT, NW_PAD]
        ok3 = ok[:, :, None]
        byte = tl.load(codes_p + t0 * s_codes_t + byte_off[:, :, None] + four * s_codes_c, mask=ok3, other=0).to(tl.uint32)
        scale = (tl.load(scales_p + t0 * s_scales_t + scale_off, mask=ok).to(tl.float32) * tscale)[:, :, None]
        x1 = e2m1_float((byte & 0x07) << 22, (byte & 0x08) << 28) * scale  # [BT, NW_PAD, 4]: the even channels (low nibbles)
        x2 = e2m1_float((byte & 0x70) << 18, (byte & 0x80) << 24) * scale  # the odd channels (high nibbles)
        if ROTARY:  # Wan's interleaved pairs: (x1 cos - x2 sin, x1 sin + x2 cos), cos at even, sin at odd channels
            if key:
                cos = tl.load(cos_p + t0 * s_cos_t + cos_off[:, :, None] + eight * s_cos_d, mask=ok3)
                if PAIRED:
                    sin = cos
                else:
                    sin = tl.load(sin_p + t0 * s_sin_t + sin_off[:, :, None] + eight * s_sin_d, mask=ok3)
                c_even, _ = tl.split(tl.reshape(cos, PAIRS))
                _, s_odd = tl.split(tl.reshape(sin, PAIRS))
                x1, x2 = x1 * c_even - x2 * s_odd, x1 * s_odd + x2 * c_even
        x = tl.reshape(tl.join(x1, x2), (BLOCK_T, NW_PAD, 8))
        tl.store(out_p + t0 * s_out_t + out_off[:, :, None] + eight * s_out_d, cast_exact(x, out_ty, SOFTWARE_BF16), mask=ok3)


def _operands(storage: NVFP4Packed, out: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    tensors = [out, storage.codes, storage.scales, storage.tensor_scale]
    return tensors, [s for x in tensors for s in x.stride()]


def _launch(segments: SegmentTable, outs: list[torch.Tensor], storages: list[NVFP4Packed], rotary: Rotary | None) -> None:
    """One launch decoding ``storages`` (1: keys or values; 2: keys then values, same layout) into ``outs``."""
    B, _, H, D = storages[0].shape
    rope = rotary_tensors(rotary) if rotary is not None else ()
    cos, sin = rope_operands(rope, outs[0])
    k_ops, strides = _operands(storages[0], outs[0])
    v_ops, _ = _operands(storages[-1], outs[-1])
    _window_kernel[(H, segments.tiles.shape[0], B * len(storages))](
        segments.tiles, cos, sin, *k_ops, *v_ops, *strides,
        cos.stride(1), cos.stride(3), sin.stride(1), sin.stride(3),
        NW=D // 8, NW_PAD=triton.next_power_of_2(D // 8), ROTARY=rotary is not None, PAIRED=len(rope) == 1, ROLES=len(storages),
        SOFTWARE_BF16=INTERPRETING, BLOCK_T=BLOCK_T, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )


def dequantize_into(storage: NVFP4Packed, segments: SegmentTable, out: torch.Tensor, rotary: Rotary | None = None) -> None:
    """Triton twin of :func:`.format.decode_reference` (one launch), for a validated call."""
    check_window_call(out, segments, [storage.codes, storage.scales], rotary)
    if len(segments.tiles) and out.shape[1]:
        _launch(segments, [out], [storage], rotary)


def dequantize_pair_into(
    key_storage: NVFP4Packed,
    value_storage: NVFP4Packed,
    segments: SegmentTable,
    key_out: torch.Tensor,
    value_out: torch.Tensor,
    rotary: Rotary | None = None,
) -> None:
    """Keys (rotated by ``rotary``) and values of one table in ONE launch; storages and workspaces of different
    layouts (shapes, dtypes or strides) take one launch each."""
    check_window_call(key_out, segments, [key_storage.codes, key_storage.scales], rotary)
    check_window_call(value_out, segments, [value_storage.codes, value_storage.scales], None)
    if not (len(segments.tiles) and key_out.shape[1]):
        return
    if one_launch_fits(_operands(key_storage, key_out), _operands(value_storage, value_out)):
        _launch(segments, [key_out, value_out], [key_storage, value_storage], rotary)
    else:
        _launch(segments, [key_out], [key_storage], rotary)
        _launch(segments, [value_out], [value_storage], None)
