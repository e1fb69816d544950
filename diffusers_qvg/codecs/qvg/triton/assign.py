"""Nearest-centroid assignment for a batch of k-means problems: the Lloyd step's and the encoder's final one.

Each program holds a block of one problem's points and sweeps all its centroids in blocks, scoring
``|c|^2 - 2 x.c`` (the point's own norm does not change the argmin) with one matrix product per block and
keeping a running minimum; ties go to the lower centroid index, as ``torch.argmin`` does. The number of
points and centroids are runtime arguments. Products use ``tf32x3`` (three TF32 passes, about float32
accuracy on tensor cores), so an id can differ from the float32 reference only where two centroids are
equally near to within rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import check_runnable

BLOCK_POINTS = 64
BLOCK_CENTROIDS = 32


@triton.jit
def _assign_kernel(
    x_ptr, c_ptr, ids_ptr,
    n_points, n_centroids,
    s_x_p, s_x_n, s_x_d,
    s_c_p, s_c_k, s_c_d,
    s_ids_p, s_ids_n,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    p = tl.program_id(1).to(tl.int64)
    points = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D_PAD)
    col_mask = (cols < D)[None, :]
    x = tl.load(
        x_ptr + p * s_x_p + points[:, None].to(tl.int64) * s_x_n + (cols * s_x_d)[None, :],
        mask=(points < n_points)[:, None] & col_mask, other=0,
    ).to(tl.float32)

    best = tl.full([BLOCK_N], float("inf"), tl.float32)
    best_id = tl.zeros([BLOCK_N], tl.int32)
    for k0 in range(0, n_centroids, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < n_centroids
        c = tl.load(
            c_ptr + p * s_c_p + ks[:, None].to(tl.int64) * s_c_k + (cols * s_c_d)[None, :],
            mask=k_mask[:, None] & col_mask, other=0,
        ).to(tl.float32)
        score = tl.sum(c * c, axis=1)[None, :] - 2.0 * tl.dot(x, tl.trans(c), input_precision=PRECISION)
        score = tl.where(k_mask[None, :], score, float("inf"))
        block_best = tl.min(score, axis=1)
        block_id = tl.argmin(score, axis=1, tie_break_left=True).to(tl.int32) + k0
        better = block_best < best  # strict: an earlier block keeps a tie
        best = tl.where(better, block_best, best)
        best_id = tl.where(better, block_id, best_id)
    tl.store(ids_ptr + p * s_ids_p + points.to(tl.int64) * s_ids_n, best_id, mask=points < n_points)


def assign(x: torch.Tensor, centroids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Index (int32 [P, N]) of each point of ``x`` [P, N, D]'s nearest row of ``centroids`` [P, K, D]."""
    check_runnable(x, centroids)
    if x.dim() != 3 or centroids.dim() != 3 or x.shape[0] != centroids.shape[0] or x.shape[2] != centroids.shape[2]:
        raise ValueError(f"expected points [P, N, D] and centroids [P, K, D], got {tuple(x.shape)} and {tuple(centroids.shape)}")
    P, N, D = x.shape
    if out is None:
        out = torch.empty(P, N, dtype=torch.int32, device=x.device)
    grid = (triton.cdiv(N, BLOCK_POINTS), P)
    _assign_kernel[grid](
        x, centroids, out, N, centroids.shape[1],
        *x.stride(), *centroids.stride(), *out.stride(),
        D=D, D_PAD=max(16, triton.next_power_of_2(D)), BLOCK_N=BLOCK_POINTS, BLOCK_K=BLOCK_CENTROIDS,
        PRECISION="tf32x3",
    )
    return out
