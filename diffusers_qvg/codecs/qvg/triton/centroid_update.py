"""Deterministic k-means centroid update: each cluster's mean summed in a fixed order, no float atomics.

flash-kmeans accumulates centroid sums with float32 ``atomic_add`` (its sorted variant still adds one
partial sum per run of equal ids per program, in whatever order the programs finish), so its centroids can
differ in the last bits between runs. Here points are sorted by cluster (a stable sort; cluster bounds by binary search), and one program
per (problem, cluster) adds its cluster's points block by block in sorted order: the same bits every run.
Empty clusters keep their previous centroid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import check_runnable
from .assign import assign

BLOCK_POINTS = 32


@triton.jit
def _centroid_update_kernel(
    x_ptr, order_ptr, start_ptr, count_ptr, old_ptr, out_ptr,
    n_centroids,
    s_x_p, s_x_n, s_x_d,
    s_order_p, s_order_n,
    s_old_p, s_old_k, s_old_d,
    s_out_p, s_out_k, s_out_d,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    p = tl.program_id(1).to(tl.int64)
    k = tl.program_id(0).to(tl.int64)
    start = tl.load(start_ptr + p * n_centroids + k)
    count = tl.load(count_ptr + p * n_centroids + k)
    cols = tl.arange(0, D_PAD)
    col_mask = cols < D
    acc = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    for i in range(0, count, BLOCK_N):
        offsets = i + tl.arange(0, BLOCK_N)
        rows = tl.load(order_ptr + p * s_order_p + (start + offsets).to(tl.int64) * s_order_n, mask=offsets < count, other=0)
        acc += tl.load(
            x_ptr + p * s_x_p + rows[:, None].to(tl.int64) * s_x_n + (cols * s_x_d)[None, :],
            mask=(offsets < count)[:, None] & col_mask[None, :], other=0,
        ).to(tl.float32)
    total = tl.sum(acc, axis=0)
    old = tl.load(old_ptr + p * s_old_p + k * s_old_k + cols * s_old_d, mask=col_mask, other=0).to(tl.float32)
    mean = tl.where(count > 0, tl.math.div_rn(total, tl.maximum(count, 1).to(tl.float32)), old)
    tl.store(out_ptr + p * s_out_p + k * s_out_k + cols * s_out_d, mean, mask=col_mask)


def update_centroids(x: torch.Tensor, ids: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """New centroids [P, K, D] (float32): the mean of the points of ``x`` [P, N, D] assigned to each by ``ids`` [P, N]."""
    check_runnable(x, ids, old)
    P, N, D = x.shape
    K = old.shape[1]
    if ids.shape != (P, N) or old.shape != (P, K, D):
        raise ValueError(f"expected ids [P, N] and old centroids [P, K, D] for points {tuple(x.shape)}, got {tuple(ids.shape)}, {tuple(old.shape)}")
    sorted_ids, order = torch.sort(ids.to(torch.int32), dim=1, stable=True)
    bounds = torch.searchsorted(sorted_ids, torch.arange(K + 1, dtype=torch.int32, device=x.device).expand(P, -1).contiguous())
    starts = bounds[:, :-1].to(torch.int32).contiguous()
    counts = (bounds[:, 1:] - bounds[:, :-1]).to(torch.int32).contiguous()
    order = order.to(torch.int32)
    out = torch.empty(P, K, D, dtype=torch.float32, device=x.device)
    _centroid_update_kernel[(K, P)](
        x, order, starts, counts, old, out, K,
        *x.stride(), *order.stride(), *old.stride(), *out.stride(),
        D=D, D_PAD=triton.next_power_of_2(D), BLOCK_N=BLOCK_POINTS,
    )
    return out


def lloyd(x: torch.Tensor, centroids: torch.Tensor, iters: int) -> torch.Tensor:
    """``iters`` deterministic Lloyd iterations from ``centroids`` [P, K, D]: no host sync, no float atomics."""
    ids = torch.empty(x.shape[:2], dtype=torch.int32, device=x.device)
    for _ in range(iters):
        centroids = update_centroids(x, assign(x, centroids, out=ids), centroids)
    return centroids
