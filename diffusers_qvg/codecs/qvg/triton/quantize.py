"""The encoder's last launch: residual codes, and every store of the write.

Per block of tokens of one problem: the residual ``r = x - C_0[id_0] - ...`` (from the problem set's ids
and stage tables; the last stage's rows from the decoded table the rounding kernel left, where it did), the
head's power-of-two shift (from the head's largest scale need, which the final assignment folded in), then
per group every scale candidate rounded to the scale format, its codes and squared error, the best candidate
(ties to the larger scale), and the packed codes. The arithmetic is the
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

The other formats' levels divide by multiplying with each group's reciprocal step and correcting the
quotient (:func:`~.numerics.quotient`), which gives the IEEE quotient exactly for these steps: no
division per element either.

Fused multiply-adds. The kernel compiles without implicit contraction, so that ``|r| - step`` stays one
subtraction whose ``|r|`` is an operand modifier (contracted with the step's product, it became a fused
multiply-add that cannot take one, and both ``r`` and ``|r|`` stayed live: spills). The one place it fuses
is written out: the squared errors chained into their sums (:func:`_sum_of_squares`), whose order of
float32 additions was never the reference's anyway. Every other product is exact (a centroid times its
power-of-two scale, a small code level times a step, a scale times the shift), fused or not.

Arrangement. The residual is held 4-D, tokens x groups x runs of LANES channels x lanes (:func:`arrangement`):
for the ternary codes (64 tokens, 4 warps) the load's layout then gives each thread whole groups, so the
14 candidates' group sums and the extents need no shuffle, each group's candidate scalars are computed
by one thread instead of four, and each packed byte folds to constant-weighted selects and adds of its
codes (no tensor-core pack).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import QVGPacked
from . import INTERPRETING, as_bits, centroid_scale_operand
from .numerics import clamp, exponent, f32_to_e4m3, pow2, pow2_at_least, quotient, rint, round_scale, round_to_format
from .problems import CENT, CODES, CSCALE, IDS, SCALES, SHIFT, SLOT, TOKEN_START, ZEROS, Problems
from .problems import grid_problem, item_value, operand_rows, problem_points, stage_points

# Tokens per program: ternary codes (division-free) / others. 64 ternary tokens pay each program's fixed work
# over twice the tokens of 32, under a 128-register cap (4 CTAs of 4 warps per SM; docs/benchmarks.md, "The
# codes kernel at 64 tokens per program").
BLOCK_TOKENS = {True: 64, False: 16}
MAX_REGISTERS = 128
WARPS = 4


@triton.jit
def group_needs(g, RUNS_AXIS: tl.constexpr, GROUPS_FIRST: tl.constexpr, SYMMETRIC: tl.constexpr, QMAX: tl.constexpr):
    """Per group of ``g`` (arranged, see :func:`arrangement`: axes ``RUNS_AXIS`` and 3 span a group): (extent or
    lo, hi, the scale the group needs before the shift) as [BLOCK, G_PAD] each."""
    if SYMMETRIC:
        extent = _group_max(tl.abs(g), RUNS_AXIS, GROUPS_FIRST)
        if QMAX == 1:
            return extent, extent, extent
        else:
            return extent, extent, tl.math.div_rn(extent, QMAX + 0.0)
    else:
        lo = _per_group(tl.min(tl.min(g, axis=3), axis=RUNS_AXIS), GROUPS_FIRST) + 0.0  # +0.0, as the reference
        hi = _group_max(g, RUNS_AXIS, GROUPS_FIRST) + 0.0
        return lo, hi, tl.maximum(tl.math.div_rn(hi - lo, QMAX + 0.0), tl.abs(lo))


@triton.jit
def _per_group(v, GROUPS_FIRST: tl.constexpr):
    """A reduced [tokens, groups] or [groups, tokens] value as [BLOCK, G_PAD] (a transpose in registers is free)."""
    if GROUPS_FIRST:
        return tl.trans(v)
    else:
        return v


@triton.jit
def _group_max(g, RUNS_AXIS: tl.constexpr, GROUPS_FIRST: tl.constexpr):
    return _per_group(tl.max(tl.max(g, axis=3), axis=RUNS_AXIS), GROUPS_FIRST)


@triton.jit
def _group_sum(g, RUNS_AXIS: tl.constexpr, GROUPS_FIRST: tl.constexpr):
    return _per_group(tl.sum(tl.sum(g, axis=3), axis=RUNS_AXIS), GROUPS_FIRST)


@triton.jit
def _spread(v, RUNS_AXIS: tl.constexpr, GROUPS_FIRST: tl.constexpr):
    """A per-group value [BLOCK, G_PAD] broadcast over the arrangement's runs and lanes."""
    return tl.expand_dims(tl.expand_dims(_per_group(v, GROUPS_FIRST), RUNS_AXIS), 3)


@triton.jit
def _on_axis(i, AXIS: tl.constexpr):
    """A 1-D index along axis ``AXIS`` (0, 1 or 2) of the arrangement."""
    if AXIS == 0:
        return i[:, None, None, None]
    elif AXIS == 1:
        return i[None, :, None, None]
    else:
        return i[None, None, :, None]


@triton.jit
def _sum_of_squares(d, RUNS_AXIS: tl.constexpr, GROUPS_FIRST: tl.constexpr, LANES: tl.constexpr):
    """Per group, the sum of ``d^2`` (arranged -> [BLOCK, G_PAD]): each run's eight lanes (one
    thread's vector) chained in fused multiply-adds, then ``tl.sum`` over the runs. ``tl.sum`` alone adds
    pairwise, 1.5 instructions per element against 1 for the chain; only the order of the float32 additions
    differs. Groups under eight channels take ``tl.sum``."""
    if LANES < 8:
        return _group_sum(d * d, RUNS_AXIS, GROUPS_FIRST)
    d = tl.reshape(d, (d.shape[0], d.shape[1], d.shape[2], 2, 2, 2))
    even, odd = tl.split(d)
    e0, e1 = tl.split(even)
    o0, o1 = tl.split(odd)
    v0, v4 = tl.split(e0)
    v2, v6 = tl.split(e1)
    v1, v5 = tl.split(o0)
    v3, v7 = tl.split(o1)
    acc = v0 * v0
    acc = tl.math.fma(v1, v1, acc)
    acc = tl.math.fma(v2, v2, acc)
    acc = tl.math.fma(v3, v3, acc)
    acc = tl.math.fma(v4, v4, acc)
    acc = tl.math.fma(v5, v5, acc)
    acc = tl.math.fma(v6, v6, acc)
    acc = tl.math.fma(v7, v7, acc)
    return _per_group(tl.sum(acc, axis=RUNS_AXIS), GROUPS_FIRST)


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
    (or NaN), so only the upper clamp can act and the sign needs no handling; quotients below 2^-26 round to 0
    in either format."""
    v = alpha * shifted_extent
    if QMAX != 1:  # the reference's float32 quotient (numerics.quotient: 15, 7, 3 have at most 4 bits)
        v = quotient(v, QMAX + 0.0, 1.0 / QMAX)
    if SYMMETRIC:
        return round_scale(v, FMT_MAX, MANTISSA == 3, INTERPRET)
    else:
        return round_to_format(clamp(v, 0.0, FMT_MAX), MANTISSA, MIN_EXPONENT)


@triton.jit
def _ternary_threshold(step):
    """Where ternary codes turn from 0 to +-1 (module docstring): ``|r| > step / 2``; never where ``step == 0``."""
    return tl.where(step > 0, step * 0.5, float("inf"))


@triton.jit
def _level_scale(shift):
    """The power of two that lifts a head's steps into :func:`~.numerics.quotient`'s range: a nonzero step is a float16
    (>= 2^-24) or e4m3 (>= 2^-9) scale times the shift (in [2^-126, 2^51]), rounded where it underflows
    (so at least half of that); lifted so that the shift is at least 2^-36, it lies in [2^-61, 2^67]. The
    quotient of the lifted operands is the same real number, and their rounded quotient the same float32;
    ``g - zero`` (at most a few times the head's need, which the shift bounds) cannot overflow."""
    return pow2(tl.maximum(-36 - exponent(shift), 0))


@triton.jit
def _levels(centered, lifted_step, LOW: tl.constexpr, QMAX: tl.constexpr, RUNS_AXIS: tl.constexpr, GROUPS_FIRST: tl.constexpr):
    """The reference's ``clamp(round_half_even((g - zero) / step), low, qmax)``, 0 where ``step == 0``, for
    arranged ``centered = g - zero`` and per-group steps [BLOCK, G_PAD], both lifted by a power of two
    (:func:`_level_scale`; ``lifted_step`` is the step as the reference rounds it, ``s * shift``, then
    lifted: an exact product) into :func:`~.numerics.quotient`'s range, which then gives the reference's
    float32 quotient without a division. One reciprocal per group: the fast division (within 2 ulps, all
    the quotient needs), of infinity where the step is 0 (or NaN), so that the level is 0. Clamping before
    rounding gives the same integer (the bounds are integers) and keeps rint within its exact range."""
    inv = _spread(1.0 / tl.where(lifted_step > 0, lifted_step, float("inf")), RUNS_AXIS, GROUPS_FIRST)
    y = quotient(centered, _spread(lifted_step, RUNS_AXIS, GROUPS_FIRST), inv)
    return rint(tl.minimum(tl.maximum(y, LOW + 0.0), QMAX + 0.0))


@triton.jit
def _level_error(g, q, step, zero_f, SYMMETRIC: tl.constexpr):
    """The reference's ``g - (q * step + zero)``. ``q * step`` is exact (a small integer times a scale of at
    most 11 significant bits, or a multiple of the smallest subnormal), so one fused multiply-add rounds
    where the reference's sum does."""
    if SYMMETRIC:
        return tl.math.fma(-q, step, g)
    else:
        return g - tl.math.fma(q, step, zero_f)


@triton.jit
def _place_value(position, TRITS: tl.constexpr, BITS: tl.constexpr):
    """A code's weight in its byte (int32): ``3^position`` for trits, else ``2^(BITS position)`` (the format's
    layout, :mod:`..format`: a byte's first code is its most significant digit)."""
    if TRITS:
        low = tl.where(position == 2, 9, tl.where(position == 1, 3, 1))
        return tl.where(position == 4, 81, tl.where(position == 3, 27, low))
    else:
        return 1 << (BITS * position)


@triton.jit
def _run_bytes(weighted, PER_BYTE: tl.constexpr):
    """Each run's bytes: its lanes' weighted codes summed in runs of ``PER_BYTE`` (arranged -> lanes / PER_BYTE)."""
    w = weighted  # (a tensor's shape, named, is no constexpr tuple when compiled)
    return tl.sum(tl.reshape(w, (w.shape[0], w.shape[1], w.shape[2], w.shape[3] // PER_BYTE, PER_BYTE)), axis=4)


@triton.jit
def _gated(mask, ok):
    """``mask`` where this write may store (``ok`` a scalar, or True ungated), else nothing. (``tl.where``: the
    interpreter cannot ``&`` a loaded scalar with a tensor.)"""
    return tl.where(ok, mask, False)


@triton.jit(do_not_specialize=["n_points", "n_centroids", "n_problems", "heads", "batch", "reverse", "s_x_b"])
def _residual_codes_kernel(
    x_ptr, items_ptr, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, heads, batch, reverse,
    s_x_b, s_x_t, s_x_h, s_x_d,
    op_ptr, need_ptr, alpha_ptr, allowed_ptr, tbits_ptr,
    codes_ptr, scales_ptr, zeros_ptr, sids_ptr, scent_ptr, scscale_ptr, shift_ptr,
    s_codes_b, s_codes_t, s_codes_h, s_codes_c,
    s_scales_b, s_scales_t, s_scales_h, s_scales_g,
    s_zeros_b, s_zeros_t, s_zeros_h, s_zeros_g,
    s_ids_b, s_ids_t, s_ids_h, s_ids_s,
    s_cent_slot, s_cent_stage, s_cent_b, s_cent_h, s_cent_k, s_cent_d,
    s_cscale_slot, s_cscale_stage, s_cscale_b, s_cscale_h, s_cscale_k,
    s_shift_slot, s_shift_b, s_shift_h,
    D: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, GROUP_BYTES: tl.constexpr,
    PER_BYTE: tl.constexpr, TRITS: tl.constexpr, SYMMETRIC: tl.constexpr, QMAX: tl.constexpr, SCALE_E4M3: tl.constexpr,
    FMT_MAX: tl.constexpr, CANDIDATES: tl.constexpr, STAGES: tl.constexpr, CENT_SCALED: tl.constexpr,
    PER_CENTROID: tl.constexpr, GATED: tl.constexpr, LAST_HELD: tl.constexpr,
    TOKEN_AXIS: tl.constexpr, GROUP_AXIS: tl.constexpr,
    BLOCK: tl.constexpr, INTERPRET: tl.constexpr, X_ALIGN: tl.constexpr,
):
    p, item, b, h = grid_problem(heads, batch, reverse)
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_mask = tokens < n_points
    G_PAD: tl.constexpr = D_PAD // GROUP
    LANES: tl.constexpr = 8 if GROUP >= 8 else GROUP
    RUNS: tl.constexpr = GROUP // LANES
    # The residual arranged 4-D, axes 0-2 the tokens, the groups and the runs of LANES channels in the order
    # :func:`arrangement` chose (axis 3 the lanes): channel run x LANES + lane of group g of a token.
    RUNS_AXIS: tl.constexpr = 3 - TOKEN_AXIS - GROUP_AXIS
    GROUPS_FIRST: tl.constexpr = GROUP_AXIS < TOKEN_AXIS
    within = _on_axis(tl.arange(0, RUNS) * LANES, RUNS_AXIS) + tl.arange(0, LANES)[None, None, None, :]
    cols = within + _on_axis(tl.arange(0, G_PAD) * GROUP, GROUP_AXIS)
    col_mask = cols < D
    at = _on_axis(tokens, TOKEN_AXIS)
    in_rows = _on_axis(row_mask, TOKEN_AXIS)
    x_row = problem_points(x_ptr, items_ptr, item, b, h, s_x_b, s_x_h, X_ALIGN)
    DECODED: tl.constexpr = STAGES - 1 if LAST_HELD else STAGES  # stages whose rows decode from the tables
    g = stage_points(
        x_row, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, s_x_t, s_x_d,
        p, at, in_rows, cols, col_mask, DECODED, D, CENT_SCALED, PER_CENTROID,
    )
    if LAST_HELD:  # the last stage's rows as the rounding kernel left them decoded (the same float32 values)
        ids = tl.load(ids_ptr + (DECODED * n_problems + p) * n_points + at, mask=in_rows, other=0)
        g = g - operand_rows(op_ptr, p, ids, in_rows, cols, col_mask, n_centroids, D)
    MANTISSA: tl.constexpr = 3 if SCALE_E4M3 else 10
    MIN_EXPONENT: tl.constexpr = -6 if SCALE_E4M3 else -14
    LOW: tl.constexpr = -QMAX if SYMMETRIC else 0
    TERNARY: tl.constexpr = SYMMETRIC and QMAX == 1

    shift = pow2_at_least(tl.math.div_rn(tl.load(need_ptr + p), FMT_MAX + 0.0))
    inv_shift = pow2(-exponent(shift))  # exact: the shift is a normal power of two at most 2^51

    lo, hi, _ = group_needs(g, RUNS_AXIS, GROUPS_FIRST, SYMMETRIC, QMAX)
    if SYMMETRIC:
        extent = hi
        zero = tl.zeros_like(hi)
        zero_f = tl.zeros_like(hi)
    else:
        zero = round_to_format(clamp(lo * inv_shift, -FMT_MAX, FMT_MAX), MANTISSA, MIN_EXPONENT)
        zero_f = zero * shift
        extent = hi - zero_f
    shifted_extent = extent * inv_shift

    if not TERNARY:  # the levels' operands: g - zero and the steps, lifted by a power of two (_level_scale)
        lift = _level_scale(shift)
        zero_fs = _spread(zero_f, RUNS_AXIS, GROUPS_FIRST)
        centered = (g - zero_fs) * lift
    best_err = tl.zeros_like(hi)
    best_s = tl.zeros_like(hi)
    for j in tl.static_range(CANDIDATES):
        s = _scale(tl.load(alpha_ptr + j), shifted_extent, QMAX, FMT_MAX, MANTISSA, MIN_EXPONENT, SYMMETRIC, INTERPRET)
        step = _spread(s * shift, RUNS_AXIS, GROUPS_FIRST)
        if TERNARY:  # |r - q step| is min(|r|, ||r| - step|), the same float32 (module docstring)
            diff = tl.minimum(tl.abs(g), tl.abs(tl.abs(g) - step))  # |g| as operand modifiers: g alone stays live
        else:
            q = _levels(centered, s * shift * lift, LOW, QMAX, RUNS_AXIS, GROUPS_FIRST)
            diff = _level_error(g, q, step, zero_fs, SYMMETRIC)
        err = _sum_of_squares(diff, RUNS_AXIS, GROUPS_FIRST, LANES)
        if j == 0:
            best_err, best_s = err, s
        else:
            better = err < best_err
            best_err = tl.where(better, err, best_err)
            best_s = tl.where(better, s, best_s)
    best_step = _spread(best_s * shift, RUNS_AXIS, GROUPS_FIRST)
    if TERNARY:  # the code, level + 1: 0, 1 or 2 (the module docstring's threshold)
        code = tl.where(tl.abs(g) > _ternary_threshold(best_step), tl.where(g > 0, 2, 0), 1)
    else:
        code = (_levels(centered, best_s * shift * lift, LOW, QMAX, RUNS_AXIS, GROUPS_FIRST) - LOW).to(tl.int32)

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
    # Each byte is its codes times their place values, summed.
    weighted = code * _place_value(PER_BYTE - 1 - within % PER_BYTE, TRITS, 8 // PER_BYTE)
    if LANES % PER_BYTE == 0:
        # A byte's codes are adjacent lanes of one run (bits): summed in the thread that holds the run, the
        # run's bytes stored as one vector, whether a group spans threads or not.
        BYTES_PER_RUN: tl.constexpr = LANES // PER_BYTE
        packed = _run_bytes(weighted, PER_BYTE)
        run_bytes = _on_axis(tl.arange(0, RUNS) * BYTES_PER_RUN, RUNS_AXIS) + tl.arange(0, BYTES_PER_RUN)[None, None, None, :]
        byte_at = at * s_codes_t + (_on_axis(groups * GROUP_BYTES, GROUP_AXIS) + run_bytes) * s_codes_c
        byte_mask = _gated(in_rows & _on_axis(groups * GROUP < D, GROUP_AXIS), ok)
        tl.store(code_row + byte_at, packed.to(tl.uint8), mask=byte_mask)
    else:
        # Trits span runs. Where a thread holds whole groups, every channel's byte and place value is a
        # constant of its register: the masks fold away, and each code costs two selects of constants and an add.
        code_at = (tokens * s_codes_t)[:, None] + (groups * (GROUP_BYTES * s_codes_c))[None, :]
        for byte in tl.static_range(GROUP_BYTES):
            value = _group_sum(tl.where(within // PER_BYTE == byte, weighted, 0), RUNS_AXIS, GROUPS_FIRST)
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


# Triton gives a load's threads to its non-contiguous axes of equal contiguity in axis order (3.6, the GPU
# machine's) or in reverse axis order (3.9); versions in between are assumed to be 3.9's.
TIES_IN_AXIS_ORDER = tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7)


def arrangement(whole_groups: bool) -> tuple[int, int]:
    """The codes kernel's axes of the tokens and the groups in its 4-D residual (the runs take the third). Threads go to the groups first,
    then (``whole_groups``: a thread per group of the block, the 64-token ternary codes) to the tokens, so
    that the runs stay in a thread's registers and a group's sums and maxima take no shuffle; else to the
    runs, then the tokens, so that a group spans threads of one warp, never warps. The axes are the order in
    which Triton hands out threads to the load's equally contiguous axes."""
    order = ("group", "token", "runs") if whole_groups else ("group", "runs", "token")
    axes = {name: (k if TIES_IN_AXIS_ORDER else 2 - k) for k, name in enumerate(order)}
    return axes["token"], axes["group"]


def launch_codes(
    problems: Problems,
    storage: QVGPacked,
    alphas: torch.Tensor,
    allowed: torch.Tensor | None = None,
    held: bool = False,
) -> None:
    """Write every field of each item's segment: the residual codes from ``problems`` (ids, stage tables, scale
    needs and magnitudes already computed), and the stages' ids and tables. ``storage`` is item 0's (the item
    table holds the others' offsets); ``alphas`` (float32 on the device) are the scale fractions to try,
    largest first. ``allowed``: int32 [I], 0 where an item may not store (its write status's verdict; None: an
    unchecked write, every item stores). ``held``: the operand scratch holds the last stage's decoded table
    (the encoder's rounding kernel left it there, :attr:`Problems.holds_table`), which the residual then
    reads instead of decoding the stored table."""
    pr, cfg = problems, storage.config
    cscale, cscale_strides = centroid_scale_operand(storage)
    zeros = storage.zeros if storage.zeros is not None else storage.scales
    D = pr.head_dim
    block = BLOCK_TOKENS[cfg.symmetric and cfg.qmax == 1]
    d_pad = triton.next_power_of_2(D)
    token_axis, group_axis = arrangement(block * (d_pad // cfg.group_size) >= 32 * WARPS)
    _residual_codes_kernel[pr.grid(triton.cdiv(pr.tokens, block))](
        *pr.point_args(pr.sweep()), pr.operands, pr.need, alphas, allowed if allowed is not None else pr.need,
        as_bits(pr.tables), storage.codes, as_bits(storage.scales), as_bits(zeros), storage.ids,
        as_bits(storage.centroids), cscale, storage.scale_shift,
        *storage.codes.stride(), *storage.scales.stride(), *zeros.stride(), *storage.ids.stride(),
        *storage.centroids.stride(), *cscale_strides, *storage.scale_shift.stride(),
        D=D, D_PAD=d_pad, GROUP=cfg.group_size, GROUP_BYTES=cfg.group_code_bytes,
        PER_BYTE=5 if cfg.trits else 8 // cfg.bits, TRITS=cfg.trits, SYMMETRIC=cfg.symmetric, QMAX=cfg.qmax,
        SCALE_E4M3=cfg.scale_dtype == "e4m3", FMT_MAX=torch.finfo(cfg.scale_torch_dtype).max,
        CANDIDATES=len(alphas), STAGES=cfg.stages, GATED=allowed is not None,
        LAST_HELD=held and cfg.stages > 0, TOKEN_AXIS=token_axis, GROUP_AXIS=group_axis, BLOCK=block,
        INTERPRET=INTERPRETING, num_warps=WARPS, enable_fp_fusion=False, maxnreg=MAX_REGISTERS,  # module docstring
        **pr.flags(),
    )  # fmt: skip
