"""Round a stage's float32 centroids to the storage's centroid format: the table the final assignment uses.

One program per problem (a per-head e4m3 scale needs the whole table's largest magnitude): e4m3 values carry
a power-of-two scale ``2^ceil(log2(amax / 448))`` per centroid or per head, so that nothing saturates, and
are rounded to nearest-even; bf16 and fp16 tables are the nearest-even cast; float32 is a copy. This is
the reference's ``round_centroids`` bit for bit. The stored bits go to the problem set's scratch table; the
codes kernel copies them into the storage with the rest of the write. Each program also zeroes its
problem's scale need and its item's magnitude (the write check), which the final assignment folds into.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRETING, as_bits
from .numerics import cast_exact, exponent, f32_to_e4m3, pow2, pow2_at_least, round_to_format
from .problems import Problems, grid_problem, problem_points, working_rows

BLOCK_CENTROIDS = 32
E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def _e4m3_value(c, scale):
    """``c / scale`` rounded to e4m3, as float32, for a power-of-two ``scale``: dividing by it is multiplying
    by its inverse exactly (the scale is a normal float32 at most 2^51 for inputs of at most 2^50)."""
    return round_to_format(c * pow2(-exponent(scale)), 3, -6)


@triton.jit(do_not_specialize=["n_points", "n_centroids", "n_problems", "heads", "batch", "reverse", "s_x_b"])
def _centroid_round_kernel(
    x_ptr, items_ptr, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, heads, batch, reverse,
    s_x_b, s_x_t, s_x_h, s_x_d,
    cent_ptr, s_c_p, s_c_k, s_c_d, out_ptr, need_ptr, magnitude_ptr, op_ptr, norm_ptr,
    D: tl.constexpr, D_PAD: tl.constexpr, STAGE: tl.constexpr, FROM_POINTS: tl.constexpr, E4M3: tl.constexpr,
    OPERANDS: tl.constexpr, CENT_SCALED: tl.constexpr, PER_CENTROID: tl.constexpr, SOFTWARE_BF16: tl.constexpr,
    BLOCK_K: tl.constexpr, X_ALIGN: tl.constexpr,
):
    p, item, b, h = grid_problem(heads, batch, reverse)
    tl.store(need_ptr + p, 0.0)  # the final assignment folds the head's scale need into it
    tl.store(magnitude_ptr + item, 0.0, mask=(b == 0) & (h == 0))  # and each item's magnitude
    cols = tl.arange(0, D_PAD)[None, :]
    col_mask = cols < D
    table = (STAGE * n_problems + p) * n_centroids
    x_row = problem_points(x_ptr, items_ptr, item, b, h, s_x_b, s_x_h, X_ALIGN)
    if E4M3 and not PER_CENTROID:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, n_centroids, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            c = working_rows(
                x_row, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, s_x_t, s_x_d,
                cent_ptr, s_c_p, s_c_k, s_c_d, p, ks[:, None], (ks < n_centroids)[:, None], cols, col_mask,
                STAGE, FROM_POINTS, D, CENT_SCALED, PER_CENTROID,
            )
            amax = tl.maximum(amax, tl.max(tl.abs(c), axis=1))
        head_scale = pow2_at_least(tl.math.div_rn(tl.max(amax, axis=0), E4M3_MAX))
        tl.store(tscales_ptr + STAGE * n_problems + p, head_scale)
    for k0 in range(0, n_centroids, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < n_centroids
        c = working_rows(
            x_row, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, s_x_t, s_x_d,
            cent_ptr, s_c_p, s_c_k, s_c_d, p, ks[:, None], k_mask[:, None], cols, col_mask, STAGE, FROM_POINTS, D,
            CENT_SCALED, PER_CENTROID,
        )
        rows = table * D + ((ks * D)[:, None] + cols)
        mask = k_mask[:, None] & col_mask
        if E4M3:
            if PER_CENTROID:
                scale = pow2_at_least(tl.math.div_rn(tl.max(tl.abs(c), axis=1), E4M3_MAX))
                tl.store(tscales_ptr + table + ks, scale, mask=k_mask)
                scale = scale[:, None]
            else:
                scale = head_scale
            value = _e4m3_value(c, scale)
            tl.store(out_ptr + rows, f32_to_e4m3(value).to(tl.uint8), mask=mask)
            value = value * scale  # the decoded table, exactly (a power-of-two scaling)
        else:
            stored = cast_exact(c, out_ptr.dtype.element_ty, SOFTWARE_BF16)
            tl.store(out_ptr + rows, stored, mask=mask)
            value = stored.to(tl.float32)
        if OPERANDS:  # the final assignment's operands and norms, once per problem instead of per program
            value = tl.where(mask, value, 0.0)
            tl.store(op_ptr + p * n_centroids * D + ((ks * D)[:, None] + cols), value, mask=mask)
            tl.store(norm_ptr + p * n_centroids + ks, tl.sum(value * value, axis=1), mask=k_mask)


def launch_round(problems: Problems, stage: int, *, from_points: bool = False, operands: bool = False) -> None:
    """Round the working centroids (the strided init's points when ``from_points``) into stage ``stage``'s
    table; with ``operands`` (where :meth:`Problems.holds_table` says the operand dtype holds it exactly),
    also leave the decoded table and its squared norms for the final assignment."""
    pr = problems
    e4m3 = pr.tables.dtype == torch.float8_e4m3fn
    D = pr.head_dim
    _centroid_round_kernel[pr.grid(1)](
        *pr.point_args(), pr.working, *pr.working.stride(), as_bits(pr.tables), pr.need, pr.magnitude,
        pr.operands, pr.norms,
        D=D, D_PAD=triton.next_power_of_2(D), STAGE=stage, FROM_POINTS=from_points, E4M3=e4m3, OPERANDS=operands,
        SOFTWARE_BF16=INTERPRETING, BLOCK_K=BLOCK_CENTROIDS, enable_fp_fusion=False, **pr.flags(),
    )  # fmt: skip
