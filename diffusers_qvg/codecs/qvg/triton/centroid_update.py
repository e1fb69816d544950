"""Deterministic k-means centroid update: each cluster's mean, summed in a fixed order, no atomics.

One program per (block of centroids, problem) first scans the problem's ids and compacts the tokens assigned
to its centroids into its own scratch row, in a fixed order (a prefix sum per block of ids, each token kept
with its centroid's place in the block); then it walks only those tokens, block by block, and adds each
block into its centroids' sums with one matrix product: a one-hot matrix ``[centroid == id]`` (exact 0/1)
times the gathered points, on tensor cores. So each of the ``K / BLOCK_CENTROIDS`` programs of a problem
multiplies about ``N / (K / BLOCK_CENTROIDS)`` points, not all ``N``: the one-hot product's work is
``2 N BLOCK_CENTROIDS D`` per problem instead of ``2 N K D``, and the points are read about once in all
(docs/benchmarks.md, "The compacted update").

Updates after a stage's first are incremental (``DELTA``): few tokens change cluster once Lloyd has started
(9% a step on video-derived K/V, ``scripts/kmeans_moves.py``), and reading every point per update makes it
memory-bound. An update that another iteration follows keeps its clusters' float32 sums and int32 sizes;
each Lloyd assignment keeps the ids it replaces; the next update compacts only the tokens whose id changed
into or out of its block and adds them with +1 at the new centroid and -1 at the old one (exact), so the
sums stay float32 sums of the points in an order fixed by the code (docs/benchmarks.md, "The encoder's
memory traffic"). An emptied cluster's sum is reset to 0.

The products are exact: stage-0 points of a bf16 (fp16) tensor are bf16 (fp16) values, and float32 points
are split exactly into three bf16 parts (8 + 8 + 8 significant bits), multiplied one after the other. So the
sums are float32 sums of the points themselves, in an order fixed by the code (the scan's, the same bits
every run), and the mean is the IEEE quotient by the count. flash-kmeans (the reference on CUDA) adds
float32 atomics instead, so its bits vary between runs; its torch fallback sums each cluster sequentially
with ``index_add_``. The order of float32 additions differs, so the results agree to float32 rounding, not
bit for bit (tests/test_triton_kmeans.py holds them to it). Empty clusters keep their previous centroid.

The product is taken transposed (points^T @ one-hot^T), so that the head dimension is the tensor cores' M.
With ``OPERANDS`` a program also leaves its new centroids rounded to the next assignment's input format
(``QVGConfig.kmeans_precision``) with their squared norms, so that the assignment's programs (37 per
problem for a 4,680-token chunk) do not each round and reduce the whole table again. With ``INIT`` a program
only takes the strided init's points as its working centroids (with their operands and norms): the
encoder's first launch of a stage, so that the first assignment, too, reads a ready table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRETING, check_runnable
from .assign import launch_assign
from .numerics import round_to_bf16
from .problems import (
    MAX_TOKENS, Problems, exact_dot, exact_format, grid_problem, lloyd_operand, points_problems, problem_points, stage_inputs,
    stage_points, working_rows,
)

# 32 centroids per program (8 programs per problem of 256), their members gathered 64 at a time, ids scanned
# 1024 at a time; 4 warps (docs/benchmarks.md, "The compacted update", with the losing tiles).
BLOCK_POINTS = 64
BLOCK_CENTROIDS = 32
assert MAX_TOKENS * BLOCK_CENTROIDS <= 2**31  # a member (token x BLOCK_CENTROIDS + place) is an int32
BLOCK_SCAN = 1024


@triton.jit
def _add_members(acc, hit, points, EXACT: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc + hit @ points`` with every product exact (``hit`` is 0/1; see the module docstring)."""
    if EXACT != "split":
        return exact_dot(tl.trans(points), tl.trans(hit.to(points.dtype)), acc, EXACT, INTERPRET)
    else:
        hit = hit.to(tl.float32)
        high = round_to_bf16(points)
        rest = points - high  # exact: the rounding error of a float32 is a float32
        middle = round_to_bf16(rest)
        hit = tl.trans(hit)
        acc = exact_dot(tl.trans(high), hit, acc, "bf16", INTERPRET)
        acc = exact_dot(tl.trans(middle), hit, acc, "bf16", INTERPRET)
        return exact_dot(tl.trans(rest - middle), hit, acc, "bf16", INTERPRET)  # the last 8 bits: exact in bf16


@triton.jit
def _compact(row, count, values, keep):
    """Append ``values`` where ``keep`` (a [SCAN_ROWS, SCAN_COLS] scan block) to ``row`` after its first
    ``count``, in the block's row-major order; returns the new count."""
    keep = keep.to(tl.int32)
    in_row = tl.cumsum(keep, 1)
    row_count = tl.sum(keep, 1)
    before_row = tl.cumsum(row_count, 0) - row_count
    tl.store(row + (count + before_row[:, None] + in_row - 1), values, mask=keep != 0)
    return count + tl.sum(row_count, 0)


@triton.jit(do_not_specialize=["n_points", "n_centroids", "n_problems", "heads", "batch", "reverse", "s_x_b"])
def _centroid_update_kernel(
    x_ptr, items_ptr, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, heads, batch, reverse,
    s_x_b, s_x_t, s_x_h, s_x_d,
    cent_ptr, s_c_p, s_c_k, s_c_d, op_ptr, norm_ptr, members_ptr, prev_ptr, sums_ptr, counts_ptr,
    D: tl.constexpr, D_PAD: tl.constexpr, STAGE: tl.constexpr, INIT: tl.constexpr, DELTA: tl.constexpr, EXACT: tl.constexpr,
    OPERANDS: tl.constexpr, PRECISION: tl.constexpr,
    CENT_SCALED: tl.constexpr, PER_CENTROID: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_SCAN: tl.constexpr, INTERPRET: tl.constexpr, X_ALIGN: tl.constexpr,
):
    p, item, b, h = grid_problem(heads, batch, reverse)
    k0 = tl.program_id(0) * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    k_mask = ks < n_centroids
    cols = tl.arange(0, D_PAD)[None, :]
    col_mask = cols < D
    x_row = problem_points(x_ptr, items_ptr, item, b, h, s_x_b, s_x_h, X_ALIGN)
    if not INIT:
        ids_row = ids_ptr + (STAGE * n_problems + p) * n_points
        prev_row = prev_ptr + p * n_points  # the ids before the last assignment (DELTA)
        # This program's members into its own scratch row, in scan order: the tokens whose id is one of its
        # centroids, each with its centroid's place in the block in one int32 (N < MAX_TOKENS, checked); with
        # DELTA, the tokens the last assignment moved into or out of them (their places are read again
        # below). A block of ids is [SCAN_ROWS, SCAN_COLS] with token n0 + c * SCAN_ROWS + r at (r, c),
        # coalesced down the rows, and compacted row by row, so each thread counts and ranks its own row's ids
        # and only the row counts are summed across threads (one prefix sum per block, not one per id).
        SCAN_ROWS: tl.constexpr = 128  # a row per thread of the 4 warps
        SCAN_COLS: tl.constexpr = BLOCK_SCAN // SCAN_ROWS
        members_row = members_ptr + (p * tl.num_programs(0) + tl.program_id(0)) * n_points
        members = 0
        for n0 in range(0, n_points, BLOCK_SCAN):
            tokens = n0 + tl.arange(0, SCAN_ROWS)[:, None] + (tl.arange(0, SCAN_COLS) * SCAN_ROWS)[None, :]
            ids = tl.load(ids_row + tokens, mask=tokens < n_points, other=-1)
            mine = (ids >= k0) & (ids < k0 + BLOCK_K)
            if DELTA:
                old = tl.load(prev_row + tokens, mask=tokens < n_points, other=-1)
                mine = (mine | ((old >= k0) & (old < k0 + BLOCK_K))) & (ids != old)
                members = _compact(members_row, members, tokens, mine)
            else:
                members = _compact(members_row, members, tokens * BLOCK_K + (ids - k0), mine)
        tl.debug_barrier()  # the row's stores are visible to every thread of the program
        if DELTA:  # the clusters as the last update left them, changed by the tokens that moved
            kept = p * n_centroids * D + ((ks * D)[:, None] + cols)
            sums = tl.trans(tl.load(sums_ptr + kept, mask=k_mask[:, None] & col_mask, other=0))
            count = tl.load(counts_ptr + p * n_centroids + ks, mask=k_mask, other=0)
        else:
            sums = tl.zeros([D_PAD, BLOCK_K], tl.float32)  # transposed: the points' D is the MMA's M
            count = tl.zeros([BLOCK_K], tl.int32)
        hits = tl.zeros([BLOCK_K, BLOCK_N], tl.int32)  # summed over the points after the loop
        places = tl.arange(0, BLOCK_K)[:, None]
        for m0 in range(0, members, BLOCK_N):
            j = m0 + tl.arange(0, BLOCK_N)
            row_mask = j < members
            member = tl.load(members_row + j, mask=row_mask, other=0)
            if DELTA:  # +1 at the token's new centroid, -1 at its old one (either may be another program's)
                tokens = member
                joined = tl.load(ids_row + tokens, mask=row_mask, other=-1) - k0
                left = tl.load(prev_row + tokens, mask=row_mask, other=-1) - k0
                hit = (places == joined[None, :]).to(tl.int32) - (places == left[None, :]).to(tl.int32)
            else:
                member = member.to(tl.uint32)
                tokens = (member // BLOCK_K).to(tl.int32)
                hit = ((places == (member % BLOCK_K).to(tl.int32)[None, :]) & row_mask[None, :]).to(tl.int32)
            hits += hit
            if STAGE == 0 and not INTERPRET:  # the input's own 16-bit values feed the tensor cores
                points = stage_inputs(x_row, tokens[:, None], row_mask[:, None], cols, col_mask, s_x_t, s_x_d)
            else:
                points = stage_points(
                    x_row, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, s_x_t, s_x_d,
                    p, tokens[:, None], row_mask[:, None], cols, col_mask, STAGE, D, CENT_SCALED, PER_CENTROID,
                )
            sums = _add_members(sums, hit, points, EXACT, INTERPRET)
    # The strided init's points (INIT: they become the working centroids, without an update), or the previous
    # centroids, which an empty cluster keeps; loaded after the member loop, which does not need them live.
    mean = working_rows(
        x_row, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, s_x_t, s_x_d,
        cent_ptr, s_c_p, s_c_k, s_c_d, p, ks[:, None], k_mask[:, None], cols, col_mask, STAGE, INIT, D,
        CENT_SCALED, PER_CENTROID,
    )
    mask = k_mask[:, None] & col_mask
    if not INIT:
        count = (count + tl.sum(hits, axis=1))[:, None]
        sums = tl.where(count > 0, tl.trans(sums), 0.0)  # an emptied cluster's sum is 0 exactly, not what rounding left
        mean = tl.where(count > 0, tl.math.div_rn(sums, tl.maximum(count, 1).to(tl.float32)), mean)
        if OPERANDS:  # another iteration follows: its update starts from these clusters
            tl.store(sums_ptr + p * n_centroids * D + ((ks * D)[:, None] + cols), sums, mask=mask)
            tl.store(counts_ptr + p * n_centroids + ks[:, None], count, mask=k_mask[:, None])
    offsets = (ks * s_c_k)[:, None] + cols * s_c_d
    tl.store(cent_ptr + p * s_c_p + offsets, mean, mask=mask)
    if OPERANDS:  # for the next assignment: rounded once here, not by each of its programs
        operand = lloyd_operand(mean, PRECISION)
        tl.store(op_ptr + p * n_centroids * D + ((ks * D)[:, None] + cols), operand, mask=mask)
        tl.store(norm_ptr + p * n_centroids + ks, tl.sum(operand * operand, axis=1), mask=k_mask)


def launch_update(
    problems: Problems, stage: int, *, init: bool = False, delta: bool = False, operands: str | None = None
) -> None:
    """Replace the working centroids by the means of stage ``stage``'s points under ``problems.ids[stage]``
    (``init``: by the strided init's points, reading no ids); ``delta``: from the clusters the previous
    update of the stage kept, changed by the tokens whose id the last assignment changed; with ``operands``
    (a k-means precision: another iteration follows), also the next assignment's operands and norms, and the
    clusters' sums and sizes for its update."""
    pr = problems
    exact = exact_format(pr.x.dtype) if stage == 0 else None
    D = pr.head_dim
    blocks = triton.cdiv(pr.centroids, BLOCK_CENTROIDS)
    _centroid_update_kernel[pr.grid(blocks)](
        *pr.point_args(0 if init else pr.sweep()), pr.working, *pr.working.stride(), pr.operands, pr.norms,
        pr.member_rows(blocks), *pr.lloyd_scratch(),
        D=D, D_PAD=max(16, triton.next_power_of_2(D)), STAGE=stage, INIT=init, DELTA=delta,
        OPERANDS=operands is not None, PRECISION=operands or "tf32x3",
        EXACT={"bf16": "bf16", "tf32": "fp16", None: "split"}[exact], BLOCK_N=BLOCK_POINTS,
        BLOCK_K=BLOCK_CENTROIDS, BLOCK_SCAN=BLOCK_SCAN, INTERPRET=INTERPRETING, num_warps=4, enable_fp_fusion=False, **pr.flags(),
    )  # fmt: skip


def update_centroids(x: torch.Tensor, ids: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """New centroids [P, K, D] (float32): the mean of the points of ``x`` [P, N, D] assigned to each by ``ids`` [P, N]."""
    check_runnable(x, ids, old)
    P, N, D = x.shape
    K = old.shape[1]
    if ids.shape != (P, N) or old.shape != (P, K, D):
        raise ValueError(f"expected ids [P, N] and old centroids [P, K, D] for points {tuple(x.shape)}, got {tuple(ids.shape)}, {tuple(old.shape)}")
    problems = points_problems(x, K)
    problems.ids.copy_(ids.view(1, P, N))
    problems.working.copy_(old)
    launch_update(problems, 0)
    return problems.working


def lloyd(x: torch.Tensor, centroids: torch.Tensor, iters: int, precision: str = "tf32x3") -> torch.Tensor:
    """``iters`` deterministic Lloyd iterations from ``centroids`` [P, K, D]: no host sync, no float atomics."""
    check_runnable(x, centroids)
    problems = points_problems(x, centroids.shape[1], precision)
    problems.working.copy_(centroids)
    for i in range(iters):
        launch_assign(problems, 0, "lloyd", source="operands" if i else "working", precision=precision)
        launch_update(problems, 0, delta=i > 0, operands=precision if i + 1 < iters else None)
    return problems.working if iters else centroids
