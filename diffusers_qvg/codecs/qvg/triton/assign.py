"""Nearest-centroid assignment for a batch of k-means problems: the Lloyd step's and the encoder's final one.

Each program holds a block of one problem's points and sweeps all its centroids in blocks, scoring
``|c|^2 - 2 x.c`` (the point's own norm does not change the argmin) with one matrix product per block and
keeping a running minimum; ties go to the lower centroid index, as ``torch.argmin`` does.

Precision. The final assignment (against the stage's rounded table) multiplies exactly: stage-0 points of a
bf16 tensor and an e4m3 or bf16 table are exact in bf16, fp16 in TF32, so a bf16 (or TF32) product with
float32 accumulation computes the same exact products as the float32 reference, which only accumulates in
another order; otherwise it uses ``tf32x3`` (about float32 accuracy). The Lloyd iterations' float32
centroids are not exact in any narrower format: they use ``QVGConfig.kmeans_precision``: ``"tf32x3"``, or
``"tf32"`` / ``"bf16"``, where points and centroids are first rounded to nearest-even in that format (as the
reference does for those settings) and then multiplied exactly. So an id can differ from the reference only
where two centroids are equally near to within float32 rounding.

With ``NEED`` (the last stage's final assignment, or the only pass when there are no stages) the program also
reduces its block's residual ``r = points - C[id]`` to the largest scale need of its groups (``max |r| / qmax``,
or ``max((hi - lo) / qmax, |lo|)`` asymmetric) and folds it into the head's need with an atomic max: of
values >= 0, whose result does not depend on the order (it lowers to an integer max), so it is
deterministic. The codes kernel turns each head's need into its shift. With ``CHECK`` it also folds the
block's largest ``|x|`` (+inf for NaN or Inf) into its item's magnitude, the same way: the write check
(NaN/Inf, magnitude limit) costs no extra pass and no PyTorch op; the codes kernel applies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRETING, check_runnable
from .problems import (
    Problems, exact_dot, exact_format, grid_problem, lloyd_operand, operand_rows, points_problems, problem_points,
    stage_inputs, stage_points, stage_rows, working_rows,
)
from .quantize import group_needs

# (points per program, centroids per step, warps) per mode, from launch-faithful sm_90 compiles of a layer
# group's K+V (docs/benchmarks.md, "Tiles"): 128-point programs read each centroid table half as often.
TILES = {"lloyd": (128, 64, 4), "final": (128, 64, 8), "none": (64, 64, 4)}


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit(do_not_specialize=["n_points", "n_centroids", "n_problems", "heads", "batch", "reverse", "s_x_b"])
def _assign_kernel(
    x_ptr, items_ptr, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, heads, batch, reverse,
    s_x_b, s_x_t, s_x_h, s_x_d,
    cent_ptr, s_c_p, s_c_k, s_c_d, op_ptr, norm_ptr, need_ptr, magnitude_ptr, prev_ptr,
    D: tl.constexpr, D_PAD: tl.constexpr, STAGE: tl.constexpr, ASSIGN: tl.constexpr, SOURCE: tl.constexpr,
    ROUND: tl.constexpr, POINTS_EXACT: tl.constexpr, FORMAT: tl.constexpr, CENT_SCALED: tl.constexpr, PER_CENTROID: tl.constexpr,
    NEED: tl.constexpr, CHECK: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, QMAX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, X_ALIGN: tl.constexpr,
):
    p, item, b, h = grid_problem(heads, batch, reverse)
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = tokens < n_points
    cols = tl.arange(0, D_PAD)[None, :]
    col_mask = cols < D
    x_row = problem_points(x_ptr, items_ptr, item, b, h, s_x_b, s_x_h, X_ALIGN)
    points = stage_points(
        x_row, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, s_x_t, s_x_d,
        p, tokens[:, None], row_mask[:, None], cols, col_mask, STAGE, D, CENT_SCALED, PER_CENTROID,
    )
    if CHECK:  # the write check: the item's largest |x|, +inf if any value is NaN or Inf
        if STAGE == 0:
            x = points
        else:
            x = stage_inputs(x_row, tokens[:, None], row_mask[:, None], cols, col_mask, s_x_t, s_x_d).to(tl.float32)
        # One NaN-propagating max per element (masked lanes load 0); a NaN found counts as +inf.
        magnitude = tl.reduce(tl.reduce(tl.abs(x), 1, _max_keeping_nan), 0, _max_keeping_nan)
        tl.atomic_max(magnitude_ptr + item, tl.where(magnitude != magnitude, float("inf"), magnitude))
    ids_at = ids_ptr + (STAGE * n_problems + p) * n_points + tokens
    if ASSIGN == "lloyd":  # the ids this assignment replaces, for the next update's changes (centroid_update)
        tl.store(prev_ptr + p * n_points + tokens, tl.load(ids_at, mask=row_mask), mask=row_mask)
        tl.debug_barrier()  # read by every thread before any thread stores its new ids below
    if ASSIGN != "none":
        a = points if POINTS_EXACT else lloyd_operand(points, ROUND)
        best = tl.full([BLOCK_N], float("inf"), tl.float32)
        best_id = tl.zeros([BLOCK_N], tl.int32)
        for k0 in range(0, n_centroids, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:  # whole blocks (256 or 64 centroids): a constant mask, which the compiler drops
                k_mask = tl.full([BLOCK_K], True, tl.int1)
            else:
                k_mask = ks < n_centroids
            if SOURCE == "operands":  # the update (or, final, the rounding) kernel left them, with their norms
                offsets = (ks * D)[:, None] + cols
                c = tl.load(op_ptr + p * n_centroids * D + offsets, mask=k_mask[:, None] & col_mask, other=0)
                if FORMAT != "bf16":  # bf16 operands of a final assignment in TF32 (exact either way)
                    c = c.to(tl.float32)
                norms = tl.load(norm_ptr + p * n_centroids + ks, mask=k_mask, other=0)
            elif ASSIGN == "final":
                c = stage_rows(
                    tables_ptr, tscales_ptr, STAGE, p, ks[:, None], k_mask[:, None], cols, col_mask, n_centroids, n_problems,
                    D, CENT_SCALED, PER_CENTROID,
                )
                norms = tl.sum(c * c, axis=1)
            else:
                c = working_rows(
                    x_row, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, s_x_t, s_x_d,
                    cent_ptr, s_c_p, s_c_k, s_c_d, p, ks[:, None], k_mask[:, None], cols, col_mask,
                    STAGE, False, D, CENT_SCALED, PER_CENTROID,
                )
                c = lloyd_operand(c, ROUND)
                norms = tl.sum(c * c, axis=1)
            products = exact_dot(a, tl.trans(c), tl.zeros([BLOCK_N, BLOCK_K], tl.float32), FORMAT, INTERPRET)
            # One rounding, as `norms - 2 * products` rounds (the doubling is exact); masked centroids score +inf.
            score = tl.math.fma(products, -2.0, tl.where(k_mask, norms, float("inf"))[None, :])
            if INTERPRET:  # numpy's reduction raises on an all-NaN row (NaN/Inf points, which the check refuses)
                score = tl.where(score == score, score, float("inf"))
            block_best, block_id = tl.min(score, axis=1, return_indices=True, return_indices_tie_break_left=True)
            block_id = block_id.to(tl.int32) + k0
            better = block_best < best  # strict: an earlier block keeps a tie
            best = tl.where(better, block_best, best)
            best_id = tl.where(better, block_id, best_id)
        # In range even for NaN/Inf points, whose scores may pick a masked centroid (such a write is refused).
        best_id = tl.minimum(best_id, n_centroids - 1)
        tl.store(ids_at, best_id, mask=row_mask)
        if NEED and ASSIGN == "final" and SOURCE == "operands":  # the decoded table, exactly: no decode, no scale
            points = points - operand_rows(op_ptr, p, best_id[:, None], row_mask[:, None], cols, col_mask, n_centroids, D)
        elif NEED:
            points = points - stage_rows(
                tables_ptr, tscales_ptr, STAGE, p, best_id[:, None], row_mask[:, None], cols, col_mask, n_centroids,
                n_problems,
                D, CENT_SCALED, PER_CENTROID,
            )
    if NEED:
        G_PAD: tl.constexpr = D_PAD // GROUP
        _, _, need = group_needs(tl.reshape(points, (1, BLOCK_N, G_PAD, GROUP)), 0, False, SYMMETRIC, QMAX)
        valid = row_mask[:, None] & (tl.arange(0, G_PAD) * GROUP < D)[None, :]
        block_need = tl.max(tl.max(tl.where(valid, need, 0.0), axis=1), axis=0)
        tl.atomic_max(need_ptr + p, block_need)  # of values >= 0: order-independent, so deterministic


def launch_assign(
    problems: Problems,
    stage: int,
    mode: str,
    *,
    source: str = "working",
    precision: str = "tf32x3",
    need: tuple[int, bool, int] | None = None,
    check: bool = False,
) -> None:
    """Assign stage ``stage``'s points; ids go to ``problems.ids[stage]``.

    ``mode``: ``"lloyd"`` against the working centroids in ``precision``: rounded here from the float32 table
    (``source="working"``), or as the update kernel left them rounded, with their norms (``"operands"``);
    ``"final"`` against the stage's rounded table, with exact products where the formats allow (decoded here,
    or as the rounding kernel left it decoded, with its norms: ``source="operands"``);
    ``"none"``: no assignment, only the scale needs of the points with every stage subtracted.
    A Lloyd assignment first keeps the ids it replaces in ``problems.previous`` (the next update's changes).
    ``need = (group_size, symmetric, qmax)`` folds the residuals' scale needs into ``problems.need``, and
    ``check`` each item's largest magnitude into ``problems.magnitude`` (both zeroed by the rounding kernel,
    or by the caller).
    """
    pr = problems
    exact = exact_format(pr.x.dtype) if stage == 0 else None  # the points' own exactness
    if mode == "final":
        table = exact_format(pr.tables.dtype)
        fmt = "bf16" if exact == table == "bf16" else "tf32" if exact and table else "tf32x3"
        rounding, points_exact = None, True
    else:
        fmt, rounding = precision, (None if precision == "tf32x3" else precision)
        points_exact = rounding is None or exact == "bf16" or (exact == "tf32" and rounding == "tf32")
    group, symmetric, qmax = need if need is not None else (pr.head_dim, True, 1)
    D = pr.head_dim
    block_n, block_k, warps = TILES[mode]
    previous = pr.lloyd_scratch()[0] if mode == "lloyd" else pr.need  # (a dummy the other modes never touch)
    _assign_kernel[pr.grid(triton.cdiv(pr.tokens, block_n))](
        *pr.point_args(pr.sweep()), pr.working, *pr.working.stride(), pr.operands, pr.norms, pr.need, pr.magnitude,
        previous,
        D=D, D_PAD=max(16, triton.next_power_of_2(D)), STAGE=stage, ASSIGN=mode, SOURCE=source,
        ROUND=rounding, POINTS_EXACT=points_exact, FORMAT=fmt, NEED=need is not None, CHECK=check, GROUP=group, SYMMETRIC=symmetric, QMAX=qmax,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=pr.centroids % block_k == 0, INTERPRET=INTERPRETING, num_stages=1, num_warps=warps, enable_fp_fusion=False,
        **pr.flags(),
    )  # fmt: skip


def assign(
    x: torch.Tensor, centroids: torch.Tensor, out: torch.Tensor | None = None, precision: str = "tf32x3"
) -> torch.Tensor:
    """Index (int32 [P, N]) of each point of ``x`` [P, N, D]'s nearest row of ``centroids`` [P, K, D]."""
    check_runnable(x, centroids)
    if x.dim() != 3 or centroids.dim() != 3 or x.shape[0] != centroids.shape[0] or x.shape[2] != centroids.shape[2]:
        raise ValueError(f"expected points [P, N, D] and centroids [P, K, D], got {tuple(x.shape)} and {tuple(centroids.shape)}")
    problems = points_problems(x, centroids.shape[1], precision)
    problems.working = centroids
    if out is not None:
        if out.dtype != torch.int32 or out.shape != x.shape[:2] or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous int32 [P, N] tensor, got {out.dtype} {tuple(out.shape)}")
        problems.ids = out.view(1, *out.shape)
    launch_assign(problems, 0, "lloyd", precision=precision)
    return problems.ids[0]

