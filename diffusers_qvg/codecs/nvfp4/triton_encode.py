"""Encode a chunk tensor to NVFP4 blocks in one Triton launch, bit-identical to :func:`.codec.encode_blocks_reference`.

Grid (heads, token tiles, batch); a program holds ``BLOCK_T`` tokens x the head's 16-channel blocks, a thread
whole blocks (their maximum and error sums stay in registers). Per block, each candidate scale (6, and for
four-over-six 4) is the reference's arithmetic in its order: IEEE divisions (``div_rn``; a ``/`` may compile
to an approximate one), the e4m3 rounding of :func:`~..qvg.triton.numerics.round_scale`, codes by the 7
midpoint comparisons of nearest-even, the squared error in units of ``g`` summed in
:func:`.codec.tree_sum16`'s order; the later candidate wins only where strictly better. Compiled without
fused multiply-adds. The second-level scales ``g`` come in (one torch reduction before the launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_backend import INTERPRETING, check_runnable, input_unsupported
from ..qvg.triton.numerics import clamp, f32_to_e4m3, round_scale
from .format import BLOCK, E2M1_MAX, E4M3_TINY, SCALE_RULES, ScaleRule
from .triton_decode import e2m1_float

E2M1_LIMIT = tl.constexpr(E2M1_MAX)  # the kernels read module constants as constexprs only
SCALE_FLOOR = tl.constexpr(E4M3_TINY)

# Tokens per program and per block of work: 16 tokens x 8 blocks per 128 threads, one block per thread.
BLOCK_T = 64 if INTERPRETING else 16
NUM_WARPS = 4


@triton.jit
def _e2m1_code(y):
    """Nearest-even e2m1 codes (int32, sign in bit 3) of float32 ``y`` with ``|y| <= 6``: a comparison with each
    midpoint, ``>=`` where the upper neighbour's mantissa bit is even (ties go to it); the sign from the bits,
    so a value rounding to 0 keeps it (-0)."""
    a = tl.abs(y)
    magnitude = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
                 + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return magnitude | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _tree_sum16(e, BT: tl.constexpr, NB: tl.constexpr):
    """[BT, NB, 16] summed over the last dim in :func:`.codec.tree_sum16`'s pairwise order: [BT, NB]."""
    a, b = tl.split(tl.reshape(e, (BT, NB, 8, 2)))
    a, b = tl.split(tl.reshape(a + b, (BT, NB, 4, 2)))
    a, b = tl.split(tl.reshape(a + b, (BT, NB, 2, 2)))
    a, b = tl.split(tl.reshape(a + b, (BT, NB, 1, 2)))
    return tl.reshape(a + b, (BT, NB))


@triton.jit
def _candidate(x, block_max, g, inv_g, MAPPED_TO: tl.constexpr, SOFTWARE: tl.constexpr):
    """The e4m3 block scale mapping each block's largest magnitude to ``MAPPED_TO`` and the block's codes under it."""
    scale = round_scale(tl.maximum(tl.math.div_rn(tl.math.div_rn(block_max, MAPPED_TO), g), SCALE_FLOOR), 448.0, True, SOFTWARE)
    recip = tl.math.div_rn(inv_g, scale)
    return scale, _e2m1_code(clamp(x * recip[:, :, None], -E2M1_LIMIT, E2M1_LIMIT))


@triton.jit
def _error(codes, scale, in_units, BT: tl.constexpr, NB: tl.constexpr):
    """Each block's squared error in units of ``g``: decoded codes x scale against ``x / g``."""
    values = e2m1_float((codes & 7) << 22, (codes & 8) << 28) * scale[:, :, None]
    d = values - in_units
    return _tree_sum16(d * d, BT, NB)


@triton.jit(do_not_specialize=["N"])  # a chunk of another length reuses the binary
def _encode_kernel(
    x_ptr, g_ptr, codes_ptr, scales_ptr, N,
    s_x_b, s_x_t, s_x_h, s_x_d, s_g_b, s_g_h,
    s_c_b, s_c_t, s_c_h, s_c_c, s_s_b, s_s_t, s_s_h, s_s_g,
    NB: tl.constexpr, NB_PAD: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, SOFTWARE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    t0 = tl.program_id(1).to(tl.int64) * BLOCK_T
    b = tl.program_id(2).to(tl.int64)
    g = tl.load(g_ptr + b * s_g_b + h * s_g_h)
    inv_g = tl.math.div_rn(1.0, g)

    t = tl.arange(0, BLOCK_T)[:, None, None]
    blk = tl.arange(0, NB_PAD)[None, :, None]
    ok = (t < N - t0) & (blk < NB)  # [BT, NB_PAD, 1]
    x_p = x_ptr + (b * s_x_b + t0 * s_x_t + h * s_x_h)
    x = tl.load(x_p + t * s_x_t + (blk * 16 + tl.arange(0, 16)[None, None, :]) * s_x_d, mask=ok, other=0).to(tl.float32)
    block_max = tl.max(tl.abs(x), axis=2)  # [BT, NB_PAD]

    scale, codes = _candidate(x, block_max, g, inv_g, 6.0, SOFTWARE)
    if FOUR_OVER_SIX:
        in_units = tl.math.div_rn(x, g)
        err = _error(codes, scale, in_units, BLOCK_T, NB_PAD)
        scale4, codes4 = _candidate(x, block_max, g, inv_g, 4.0, SOFTWARE)
        better = _error(codes4, scale4, in_units, BLOCK_T, NB_PAD) < err
        scale = tl.where(better, scale4, scale)
        codes = tl.where(better[:, :, None], codes4, codes)

    low, high = tl.split(tl.reshape(codes, (BLOCK_T, NB_PAD, 8, 2)))  # channels 2j and 2j + 1
    c_p = codes_ptr + (b * s_c_b + t0 * s_c_t + h * s_c_h)
    tl.store(c_p + t * s_c_t + (blk * 8 + tl.arange(0, 8)[None, None, :]) * s_c_c, (low | (high << 4)).to(tl.uint8), mask=ok)
    s_p = scales_ptr + (b * s_s_b + t0 * s_s_t + h * s_s_h)
    t2 = tl.arange(0, BLOCK_T)[:, None]
    blk2 = tl.arange(0, NB_PAD)[None, :]
    tl.store(s_p + t2 * s_s_t + blk2 * s_s_g, f32_to_e4m3(scale).to(tl.uint8), mask=(t2 < N - t0) & (blk2 < NB))


def encode_blocks(x: torch.Tensor, g: torch.Tensor, scale_rule: ScaleRule) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`.codec.encode_blocks_reference` (one launch)."""
    check_runnable(x, g)
    B, N, H, D = x.shape
    if why := input_unsupported(x):
        raise ValueError(f"the Triton NVFP4 encoder cannot take a {why}; use the torch backend")
    codes = torch.empty(B, N, H, D // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(B, N, H, D // BLOCK, dtype=torch.float8_e4m3fn, device=x.device)
    if x.numel():
        bits = scales.view(torch.uint8)
        _encode_kernel[(H, triton.cdiv(N, BLOCK_T), B)](
            x, g, codes, bits, N, *x.stride(), *g.stride(), *codes.stride(), *bits.stride(),
            NB=D // BLOCK, NB_PAD=triton.next_power_of_2(D // BLOCK), FOUR_OVER_SIX=len(SCALE_RULES[scale_rule][1]) == 2,
            SOFTWARE=INTERPRETING, BLOCK_T=BLOCK_T, num_warps=NUM_WARPS, enable_fp_fusion=False,
        )
    return codes, scales
