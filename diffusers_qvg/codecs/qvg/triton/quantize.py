"""The encoder's last launch: residual codes, and every store of the write.

Per block of tokens of one problem: the residual ``r = x - C_0[id_0] - ...`` (from the problem set's ids
and stage tables), the head's power-of-two shift (from the head's largest scale need, which the final
assignment folded in), then per group every scale candidate rounded to the scale format, its codes and
squared error, the best candidate (ties to the larger scale), and the packed codes. The arithmetic is the
reference's (:func:`~diffusers_qvg.codecs.groups.quantize_groups`); only the order of each error's float32
sum differs, so a group whose two best candidates tie to within rounding may pick the other one.

This kernel also makes every store of the write: codes, scales, zeros, the slot's shift, and each stage's
ids, centroids and centroid scales (copied from the problem set's scratch). With a write status, each
program reads its item's verdict once (``allowed``, which :meth:`~diffusers_qvg.codecs.status.WriteStatus.check_batch`
computed on the device from the magnitudes the final assignment folded: no earlier write failed and no item of
the batch before it did) and stores nothing otherwise; so a failed write changes no byte and nothing waits for
the host.

Division-free ternary codes (symmetric INT2, ``qmax = 1``). The reference computes
``q = clamp(round_half_even(fl(r / step)), -1, 1)``, with ``fl`` IEEE float32 division. ``q = 0`` exactly
when ``fl(|r| / step) <= 0.5``: 0.5 is a float32 whose successor is ``0.5 + 2^-24``, so ``fl(y) <= 0.5``
iff ``y <= 0.5 + 2^-25`` (the midpoint rounds to 0.5, whose significand is even), i.e. iff
``|r| <= h (1 + 2^-24)`` with ``h = step / 2`` (exact: a power-of-two scaling of a value with at most 11
significant bits, far above the float32 subnormal floor). Any float32 ``|r| > h`` exceeds ``h`` by at least
one ulp of ``h``, and ``ulp(h) = 2^(e_h - 23) > h 2^-24`` for ``h`` in ``[2^e_h, 2^(e_h + 1))`` (also for a
subnormal ``h``, whose ulp is ``2^-149``): so ``q = 0`` iff ``|r| <= step / 2``, compared exactly in
float32, and otherwise ``q = sign(r)`` (any other rounding is clamped to +-1). The error term
``(r - q step)^2`` is then ``(|r| - step)^2`` or ``r^2``, the same float32 value (negation is exact).
The candidate loop takes ``|r - q step|`` as ``min(|r|, |fl(|r| - step)|)``, one subtraction and one min per
element, without the threshold: for ``|r| <= step / 2`` (or ``step == 0``), ``step - |r| >= |r|``, so the
rounded difference is at least ``|r|`` and the min is ``|r|``; for ``step / 2 < |r| <= 2 step`` the
difference is exact (Sterbenz) and smaller than ``|r|``; above ``2 step`` it is ``fl(|r| - step) <= |r|``,
the value the codes use either way. So every element's error term is the same float32 as the reference's.
The scale candidates ``alpha extent / qmax / shift`` need no division either: ``/ 1`` is exact and dividing by a
power of two is multiplying by its (exact) inverse, both the correctly rounded result of the same number.

Fused multiply-adds. Every product this kernel adds to something is exact (a centroid times its power-of-two
scale, a small code level times a step, a scale times the shift, the rounding helpers' power-of-two
scalings), so contracting it into an FMA cannot change the result; the squared errors are the only rounded
products, and their sums are already in an order of the hardware's. So the kernel compiles with FMA
contraction, which fuses the squares into the error sums.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..format import QVGPacked
from . import INTERPRETING, as_bits, centroid_scale_operand
from .numerics import clamp, exponent, f32_to_e4m3, pow2, pow2_at_least, rint, round_scale, round_to_format
from .problems import CENT, CODES, CSCALE, IDS, SCALES, SHIFT, SLOT, TOKEN_START, ZEROS, Problems
from .problems import exact_dot, grid_problem, item_value, problem_points, stage_points

# Tokens per program: ternary codes (division-free) / others. 64 ternary tokens pay each program's fixed work
# over twice the tokens of 32, under a 128-register cap (4 CTAs of 4 warps per SM; docs/benchmarks.md, "The
# codes kernel at 64 tokens per program").
BLOCK_TOKENS = {True: 64, False: 16}
MAX_REGISTERS = 128


@triton.jit
def group_needs(r, BLOCK: tl.constexpr, G_PAD: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, QMAX: tl.constexpr):
    """Per group: (extent or lo, hi, the scale the group needs before the shift) as [BLOCK, G_PAD] each."""
    g = tl.reshape(r, (BLOCK, G_PAD, GROUP))
    if SYMMETRIC:
        extent = tl.max(tl.abs(g), axis=2)
        if QMAX == 1:
            return extent, extent, extent
        else:
            return extent, extent, tl.math.div_rn(extent, QMAX + 0.0)
    else:
        lo = tl.min(g, axis=2)
        hi = tl.max(g, axis=2)
        return lo, hi, tl.maximum(tl.math.div_rn(hi - lo, QMAX + 0.0), tl.abs(lo))


@triton.jit
def _sum_of_squares(d, BLOCK: tl.constexpr, G_PAD: tl.constexpr, GROUP: tl.constexpr):
    """Per group, the sum of ``d^2`` over its ``GROUP`` elements ([BLOCK, G_PAD, GROUP] -> [BLOCK, G_PAD]): each
    run of eight neighbours (one thread's vector in the layout of the load) chained in fused multiply-adds,
    then ``tl.sum`` over the runs.
    ``tl.sum`` alone adds pairwise, 1.5 instructions per element against 1 for the chain; only the order of
    the float32 additions differs. Groups under eight channels take ``tl.sum``."""
    if GROUP < 8:
        return tl.sum(d * d, axis=2)
    d = tl.reshape(d, (BLOCK, G_PAD, GROUP // 8, 2, 2, 2))
    even, odd = tl.split(d)
    e0, e1 = tl.split(even)
    o0, o1 = tl.split(odd)
    v0, v4 = tl.split(e0)
    v2, v6 = tl.split(e1)
    v1, v5 = tl.split(o0)
    v3, v7 = tl.split(o1)
    acc = v0 * v0
    acc = acc + v1 * v1
    acc = acc + v2 * v2
    acc = acc + v3 * v3
    acc = acc + v4 * v4
    acc = acc + v5 * v5
    acc = acc + v6 * v6
    acc = acc + v7 * v7
    return tl.sum(acc, axis=2)


@triton.jit
def _scale(
    alpha, shifted_extent, QMAX: tl.constexpr, FMT_MAX: tl.constexpr, MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr, SYMMETRIC: tl.constexpr, INTERPRET: tl.constexpr,
):
    """The candidate scale ``fmt(clamp(alpha * extent / qmax / shift, 0, fmt_max))``, as float32, from
    ``shifted_extent = extent / shift`` (taken once per group, not per candidate). The shift is a power of
    two, so dividing by it first is exact and gives the same float32 except where the quotient falls below
    the float32 normals, a value every scale format rounds to 0 either way (and the shift keeps ``extent /
    shift`` within a small multiple of ``fmt_max``: nothing overflows). A symmetric extent is ``max |r| >= 0``
    (or NaN), so only the upper clamp can act and the sign needs no handling."""
    v = alpha * shifted_extent
    if QMAX != 1:
        v = tl.math.div_rn(v, QMAX + 0.0)
    if SYMMETRIC:
        return round_scale(v, FMT_MAX, MANTISSA == 3, INTERPRET)
    else:
        return round_to_format(clamp(v, 0.0, FMT_MAX), MANTISSA, MIN_EXPONENT)


@triton.jit
def _ternary_threshold(step):
    """Where ternary codes turn from 0 to +-1 (module docstring): ``|r| > step / 2``; never where ``step == 0``."""
    return tl.where(step > 0, step * 0.5, float("inf"))


@triton.jit
def _levels(g, step, zero_f, LOW: tl.constexpr, QMAX: tl.constexpr, TERNARY: tl.constexpr):
    """The reference's ``clamp(round_half_even((g - zero) / step), low, qmax)``, 0 where ``step == 0``."""
    if TERNARY:
        return tl.where(tl.abs(g) > _ternary_threshold(step), tl.where(g > 0, 1.0, -1.0), 0.0)
    else:
        y = tl.math.div_rn(g - zero_f, tl.where(step > 0, step, 1.0))
        y = tl.minimum(tl.maximum(y, LOW - 1.0), QMAX + 1.0)  # rint is exact below 2^22
        return tl.where(step > 0, tl.minimum(tl.maximum(rint(y), LOW + 0.0), QMAX + 0.0), 0.0)


@triton.jit
def _gated(mask, ok):
    """``mask`` where this write may store (``ok`` a scalar, or True ungated), else nothing. (``tl.where``: the
    interpreter cannot ``&`` a loaded scalar with a tensor.)"""
    return tl.where(ok, mask, False)


@triton.jit(do_not_specialize=["n_points", "n_centroids", "n_problems", "heads", "batch", "s_x_b"])
def _residual_codes_kernel(
    x_ptr, items_ptr, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, heads, batch,
    s_x_b, s_x_t, s_x_h, s_x_d,
    need_ptr, alpha_ptr, allowed_ptr, pack_ptr, tbits_ptr,
    codes_ptr, scales_ptr, zeros_ptr, sids_ptr, scent_ptr, scscale_ptr, shift_ptr,
    s_codes_b, s_codes_t, s_codes_h, s_codes_c,
    s_scales_b, s_scales_t, s_scales_h, s_scales_g,
    s_zeros_b, s_zeros_t, s_zeros_h, s_zeros_g,
    s_ids_b, s_ids_t, s_ids_h, s_ids_s,
    s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
    s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k,
    s_shift_slot, s_shift_b, s_shift_h,
    D: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, GROUP_BYTES: tl.constexpr, BYTES_PAD: tl.constexpr,
    PER_BYTE: tl.constexpr, SYMMETRIC: tl.constexpr, QMAX: tl.constexpr, SCALE_E4M3: tl.constexpr,
    FMT_MAX: tl.constexpr, CANDIDATES: tl.constexpr, STAGES: tl.constexpr, CENT_SCALED: tl.constexpr,
    PER_CENTROID: tl.constexpr, GATED: tl.constexpr,
    BLOCK: tl.constexpr, INTERPRET: tl.constexpr, X_ALIGN: tl.constexpr,
):
    p, item, b, h = grid_problem(heads, batch)
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_mask = tokens < n_points
    cols = tl.arange(0, D_PAD)
    col_mask = cols < D
    x_row = problem_points(x_ptr, items_ptr, item, b, h, s_x_b, s_x_h, X_ALIGN)
    r = stage_points(
        x_row, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, s_x_t, s_x_d,
        p, tokens, row_mask, cols, col_mask, STAGES, D, CENT_SCALED, PER_CENTROID,
    )
    G_PAD: tl.constexpr = D_PAD // GROUP
    MANTISSA: tl.constexpr = 3 if SCALE_E4M3 else 10
    MIN_EXPONENT: tl.constexpr = -6 if SCALE_E4M3 else -14
    LOW: tl.constexpr = -QMAX if SYMMETRIC else 0
    TERNARY: tl.constexpr = SYMMETRIC and QMAX == 1

    shift = pow2_at_least(tl.math.div_rn(tl.load(need_ptr + p), FMT_MAX + 0.0))
    inv_shift = pow2(-exponent(shift))  # exact: the shift is a normal power of two at most 2^51

    g = tl.reshape(r, (BLOCK, G_PAD, GROUP))
    lo, hi, _ = group_needs(r, BLOCK, G_PAD, GROUP, SYMMETRIC, QMAX)
    if SYMMETRIC:
        extent = hi
        zero = tl.zeros_like(hi)
        zero_f = tl.zeros_like(hi)
    else:
        zero = round_to_format(clamp(lo * inv_shift, -FMT_MAX, FMT_MAX), MANTISSA, MIN_EXPONENT)
        zero_f = zero * shift
        extent = hi - zero_f
    a = tl.abs(g)
    shifted_extent = extent * inv_shift

    best_err = tl.zeros_like(hi)
    best_s = tl.zeros_like(hi)
    for j in tl.static_range(CANDIDATES):
        s = _scale(tl.load(alpha_ptr + j), shifted_extent, QMAX, FMT_MAX, MANTISSA, MIN_EXPONENT, SYMMETRIC, INTERPRET)
        step = (s * shift)[:, :, None]
        if TERNARY:  # |r - q step| is min(|r|, ||r| - step|), the same float32 (module docstring)
            diff = tl.minimum(a, tl.abs(a - step))
        else:
            q = _levels(g, step, zero_f[:, :, None], LOW, QMAX, TERNARY)
            if SYMMETRIC:
                diff = g - q * step
            else:
                diff = g - (q * step + zero_f[:, :, None])
        err = _sum_of_squares(diff, BLOCK, G_PAD, GROUP)
        if j == 0:
            best_err, best_s = err, s
        else:
            better = err < best_err
            best_err = tl.where(better, err, best_err)
            best_s = tl.where(better, s, best_s)
    code = _levels(g, (best_s * shift)[:, :, None], zero_f[:, :, None], LOW, QMAX, TERNARY) - LOW  # exact, float32

    # The stores: nothing unless this item's write is clean.
    ok = True
    if GATED:
        ok = tl.load(allowed_ptr + item) != 0
    first = item_value(items_ptr, item, TOKEN_START)  # the segment's first token in the storage
    slot = item_value(items_ptr, item, SLOT)
    groups = tl.arange(0, G_PAD)
    mask = _gated(row_mask[:, None] & (groups * GROUP < D)[None, :], ok)
    scale_row = scales_ptr + item_value(items_ptr, item, SCALES) + b * s_scales_b + h * s_scales_h + first * s_scales_t
    scale_at = (tokens * s_scales_t)[:, None] + (groups * s_scales_g)[None, :]
    if SCALE_E4M3:
        tl.store(scale_row + scale_at, f32_to_e4m3(best_s).to(tl.uint8), mask=mask)
    else:
        tl.store(scale_row + scale_at, best_s.to(tl.float16), mask=mask)
    if not SYMMETRIC:
        zero_row = zeros_ptr + item_value(items_ptr, item, ZEROS) + b * s_zeros_b + h * s_zeros_h + first * s_zeros_t
        zero_at = (tokens * s_zeros_t)[:, None] + (groups * s_zeros_g)[None, :]
        if SCALE_E4M3:
            tl.store(zero_row + zero_at, f32_to_e4m3(zero).to(tl.uint8), mask=mask)
        else:
            tl.store(zero_row + zero_at, zero.to(tl.float16), mask=mask)

    code_row = codes_ptr + item_value(items_ptr, item, CODES) + b * s_codes_b + h * s_codes_h + first * s_codes_t
    code_at = (tokens * s_codes_t)[:, None] + (groups * (GROUP_BYTES * s_codes_c))[None, :]
    if GROUP >= 16:  # pack on tensor cores: codes [.., GROUP] @ place values [GROUP, bytes], small exact integers
        levels = tl.reshape(code, (BLOCK * G_PAD, GROUP))
        j = tl.arange(0, GROUP)
        k = tl.arange(0, BYTES_PAD)
        weights = tl.load(pack_ptr + (j[:, None] * BYTES_PAD + k[None, :]))
        packed = exact_dot(levels, weights, tl.zeros([BLOCK * G_PAD, BYTES_PAD], tl.float32), "bf16", INTERPRET)
        packed = tl.reshape(packed, (BLOCK, G_PAD, BYTES_PAD)).to(tl.int32)
        at = code_at[:, :, None] + (k * s_codes_c)[None, None, :]
        tl.store(code_row + at, packed.to(tl.uint8), mask=mask[:, :, None] & (k < GROUP_BYTES)[None, None, :])
    else:
        within = tl.arange(0, GROUP)
        weights = tl.load(pack_ptr + within * BYTES_PAD + within // PER_BYTE)
        weighted = code.to(tl.int32) * weights[None, None, :].to(tl.int32)
        for byte in tl.static_range(GROUP_BYTES):
            value = tl.sum(tl.where((within // PER_BYTE == byte)[None, None, :], weighted, 0), axis=2)
            tl.store(code_row + (code_at + byte * s_codes_c), value.to(tl.uint8), mask=mask)

    id_row = sids_ptr + item_value(items_ptr, item, IDS) + b * s_ids_b + h * s_ids_h + first * s_ids_t
    for t in tl.static_range(STAGES):
        ids = tl.load(ids_ptr + (t * n_problems + p) * n_points + tokens, mask=row_mask, other=0)
        tl.store(id_row + (tokens * s_ids_t + t * s_ids_s), ids, mask=_gated(row_mask, ok))

    shift_at = item_value(items_ptr, item, SHIFT) + slot * s_shift_slot + b * s_shift_b + h * s_shift_h
    tl.store(shift_ptr + shift_at, shift, mask=_gated(tl.program_id(0) == 0, ok))
    _store_tables(
        tbits_ptr, tscales_ptr, scent_ptr, scscale_ptr, items_ptr, item, slot, b, h, p, n_centroids, n_problems,
        s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
        s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k, ok,
        D, D_PAD, STAGES, CENT_SCALED, PER_CENTROID,
    )


@triton.jit
def _store_tables(
    tbits_ptr, tscales_ptr, scent_ptr, scscale_ptr, items_ptr, item, slot, b, h, p, n_centroids, n_problems,
    s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
    s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k, ok,
    D: tl.constexpr, D_PAD: tl.constexpr, STAGES: tl.constexpr, CENT_SCALED: tl.constexpr, PER_CENTROID: tl.constexpr,
):
    """Copy problem ``p``'s stage tables (stored bits) and their scales from the scratch into the slot: the
    token programs share each stage's rows (row ``k`` goes to program ``k mod programs``), so every program
    runs the same code; the stages are unrolled, so no row index is divided."""
    cols = tl.arange(0, D_PAD)
    col_mask = cols < D
    cent_row = scent_ptr + item_value(items_ptr, item, CENT) + slot * s_cent_slot + b * s_cent_b + h * s_cent_h
    cscale_at = item_value(items_ptr, item, CSCALE) + slot * s_cscale_slot + b * s_cscale_b + h * s_cscale_h
    for t in tl.static_range(STAGES):
        table = (t * n_problems + p) * n_centroids
        for k in range(tl.program_id(0), n_centroids, tl.num_programs(0)):
            bits = tl.load(tbits_ptr + (table + k) * D + cols, mask=_gated(col_mask, ok))
            tl.store(cent_row + t * s_cent_stage + k * s_cent_k + cols * s_cent_d, bits, mask=_gated(col_mask, ok))
            if CENT_SCALED:
                if PER_CENTROID:
                    scale = tl.load(tscales_ptr + table + k)
                else:
                    scale = tl.load(tscales_ptr + t * n_problems + p)
                tl.store(scscale_ptr + cscale_at + t * s_cscale_stage + k * s_cscale_k, scale, mask=ok)


def bytes_pad(cfg) -> int:
    """Packed bytes per group, padded to a tensor-core tile width."""
    return max(16, triton.next_power_of_2(cfg.group_code_bytes))


@functools.lru_cache(maxsize=16)
def _place_values(trits: bool, bits: int, group: int, width: int, device: torch.device) -> torch.Tensor:
    per_byte = 5 if trits else 8 // bits
    table = torch.zeros(group, width)
    for j in range(group):
        position = per_byte - 1 - j % per_byte  # the first code of a byte is its most significant digit
        table[j, j // per_byte] = 3**position if trits else 2 ** (bits * position)
    return table.to(device)


def place_values(cfg, device: torch.device) -> torch.Tensor:
    """float32 [group_size, bytes_pad]: the place value of each code of a group in its byte (base 3 for trits,
    ``2^bits`` otherwise; the format's layout, :mod:`..format`), built once per device."""
    return _place_values(cfg.trits, cfg.bits, cfg.group_size, bytes_pad(cfg), device)


def launch_codes(
    problems: Problems,
    storage: QVGPacked,
    alphas: torch.Tensor,
    allowed: torch.Tensor | None = None,
) -> None:
    """Write every field of each item's segment: the residual codes from ``problems`` (ids, stage tables, scale
    needs and magnitudes already computed), and the stages' ids and tables. ``storage`` is item 0's (the item
    table holds the others' offsets); ``alphas`` (float32 on the device) are the scale fractions to try,
    largest first. ``allowed``: int32 [I], 0 where an item may not store (its write status's verdict; None: an
    unchecked write, every item stores)."""
    pr, cfg = problems, storage.config
    cscale, cscale_strides = centroid_scale_operand(storage)
    zeros = storage.zeros if storage.zeros is not None else storage.scales
    D = pr.head_dim
    block = BLOCK_TOKENS[cfg.symmetric and cfg.qmax == 1]
    _residual_codes_kernel[pr.grid(triton.cdiv(pr.tokens, block))](
        *pr.point_args(), pr.need, alphas, allowed if allowed is not None else pr.need, place_values(cfg, pr.x.device),
        as_bits(pr.tables), storage.codes, as_bits(storage.scales), as_bits(zeros), storage.ids,
        as_bits(storage.centroids), cscale, storage.scale_shift,
        *storage.codes.stride(), *storage.scales.stride(), *zeros.stride(), *storage.ids.stride(),
        *storage.centroids.stride(), *cscale_strides, *storage.scale_shift.stride(),
        D=D, D_PAD=triton.next_power_of_2(D), GROUP=cfg.group_size, GROUP_BYTES=cfg.group_code_bytes,
        BYTES_PAD=bytes_pad(cfg), PER_BYTE=5 if cfg.trits else 8 // cfg.bits, SYMMETRIC=cfg.symmetric, QMAX=cfg.qmax,
        SCALE_E4M3=cfg.scale_dtype == "e4m3", FMT_MAX=torch.finfo(cfg.scale_torch_dtype).max,
        CANDIDATES=len(alphas), STAGES=cfg.stages, GATED=allowed is not None, BLOCK=block,
        INTERPRET=INTERPRETING, enable_fp_fusion=True, maxnreg=MAX_REGISTERS, **pr.flags(),  # see the module docstring
    )  # fmt: skip
