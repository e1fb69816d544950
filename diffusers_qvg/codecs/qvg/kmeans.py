"""Batched Euclidean k-means for QVG, the reference: deterministic inits, Lloyd iterations (flash-kmeans for
float32-accurate assignments, a PyTorch loop for bf16/TF32-rounded ones), assignment.

Points come as ``x`` [P, N, D] (P = batch * heads problems of N points each, batch-major). Every random draw
uses the caller's ``torch.Generator``; the global RNG is never touched (flash-kmeans itself would draw its init
from the global RNG, so we always pass ``init_centroids``). Draws are made for every head of the model and
the problems' own heads kept (:func:`draw_for_heads`), so a head-sharded cache (one rank's heads under Ulysses)
inits each head exactly as one process holding all heads does.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Literal

import torch

from ..base import HeadSlice

KMeansInit = Literal["kmeans++", "strided", "random"]
KMeansPrecision = Literal["tf32x3", "tf32", "bf16"]


def squared_distances(x: torch.Tensor, x_sq: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``|x - c|^2`` [P, N, K] for ``x`` [P, N, D] (``x_sq`` its squared norms [P, N, 1]) and ``centroids``
    [P, K, D], clamped at 0."""
    c_sq = centroids.square().sum(-1).unsqueeze(1)
    return torch.baddbmm(x_sq + c_sq, x, centroids.transpose(1, 2), alpha=-2).clamp_min_(0)


def assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index [P, N] (int64) of each point's nearest centroid; ties go to the lower index.

    Uses ``|c|^2 - 2 x.c`` (the point's own norm does not change the argmin and only adds rounding).
    """
    score = centroids.square().sum(-1).unsqueeze(1) - 2 * torch.bmm(x, centroids.transpose(1, 2))
    return score.argmin(-1)


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[p, index[p, n]]`` for ``table`` [P, K, D] and ``index`` [P, N] -> [P, N, D]."""
    return torch.gather(table, 1, index.unsqueeze(-1).expand(-1, -1, table.shape[-1]))


def draw_for_heads(
    draw: Callable[[tuple[int, ...]], torch.Tensor], P: int, heads: HeadSlice | None, *size: int
) -> torch.Tensor:
    """``draw(shape)`` for the ``P = batch * heads.count`` problems, [P, *size]: drawn as
    [batch, heads.total, *size] and this call's heads kept, so every rank of a head-sharded cache draws what
    one process holding all heads draws, and advances its generator as far. A generator's numbers do not
    depend on the shape they fill, only on how many are drawn (tested on the CPU; torch's CUDA Philox kernels
    index their stream by element as well, not run on a GPU here), so for one process this is the draw of
    ``(P, *size)`` exactly (``heads=None`` draws just that)."""
    if heads is None:
        return draw((P, *size))
    batch = P // heads.count
    return draw((batch, heads.total, *size))[:, heads.start : heads.start + heads.count].reshape(P, *size)


def kmeans_init(
    x: torch.Tensor, num_centroids: int, method: KMeansInit, generator: torch.Generator, heads: HeadSlice | None = None
) -> torch.Tensor:
    """Initial centroids [P, K, D] drawn from the points of ``x`` [P, N, D].

    ``"strided"`` takes tokens ``floor(i * N / K)`` (free, no randomness); ``"random"`` draws tokens
    uniformly with replacement (the official init, here seeded); ``"kmeans++"`` is greedy D^2 sampling.
    ``heads``: which of the model's heads the problems are (``None``: all); see :func:`draw_for_heads`.
    """
    P, N, _ = x.shape
    if method == "strided":
        index = (torch.arange(num_centroids, device=x.device) * N // num_centroids).expand(P, -1)
        return gather_rows(x, index)
    if method == "random":
        draw = partial(torch.randint, 0, N, device=x.device, generator=generator)
        return gather_rows(x, draw_for_heads(draw, P, heads, num_centroids))
    if method == "kmeans++":
        return _greedy_kmeans_plusplus(x, num_centroids, generator, heads)
    raise ValueError(f"unknown k-means init {method!r}; use 'kmeans++', 'strided' or 'random'")


def _greedy_kmeans_plusplus(
    x: torch.Tensor, num_centroids: int, generator: torch.Generator, heads: HeadSlice | None
) -> torch.Tensor:
    """Greedy k-means++ (Arthur & Vassilvitskii; scikit-learn's default): each step draws
    ``2 + floor(ln K)`` candidates with probability proportional to D^2 and keeps the one that lowers the
    total D^2 most. Sampling is by inverse CDF (``searchsorted``), so it needs no host sync.
    """
    P, N, D = x.shape
    trials = 2 + int(math.log(num_centroids))
    rows = torch.arange(P, device=x.device)
    centroids = x.new_empty(P, num_centroids, D)
    first = draw_for_heads(partial(torch.randint, 0, N, device=x.device, generator=generator), P, heads)
    uniform = partial(torch.rand, device=x.device, dtype=x.dtype, generator=generator)
    centroids[:, 0] = x[rows, first]
    x_sq = x.square().sum(-1, keepdim=True)
    closest = squared_distances(x, x_sq, centroids[:, :1]).squeeze(-1)  # [P, N]
    for k in range(1, num_centroids):
        cdf = closest.cumsum(-1)
        target = draw_for_heads(uniform, P, heads, trials) * cdf[:, -1:]
        candidates = torch.searchsorted(cdf, target, right=True).clamp_max_(N - 1)  # [P, trials]
        points = gather_rows(x, candidates)  # [P, trials, D]
        reduced = torch.minimum(closest.unsqueeze(-1), squared_distances(x, x_sq, points))  # [P, N, trials]
        best = reduced.sum(1).argmin(-1)  # [P]
        centroids[:, k] = points[rows, best]
        closest = reduced[rows, :, best]
    return centroids


def lloyd(x: torch.Tensor, centroids: torch.Tensor, iters: int, precision: KMeansPrecision = "tf32x3") -> torch.Tensor:
    """Run ``iters`` Lloyd iterations from ``centroids`` [P, K, D]; empty clusters keep their centroid.

    ``precision`` is the format the assignment step multiplies points and centroids in (the Triton kernels'
    ``QVGConfig.kmeans_precision``): ``"tf32x3"`` is about float32 and runs flash-kmeans as it is; ``"tf32"``
    and ``"bf16"`` round both operands to nearest-even in that format first (exactly what the kernels feed
    their tensor cores), then assign and average as below; the means are of the unrounded points.

    flash-kmeans, for ``"tf32x3"``: on CUDA float32/16 its Triton ``batch_kmeans_Euclid``, which checks
    ``shift < tol`` on the host after every iteration (one sync per iteration) and accumulates centroid sums
    with float32 atomics, so GPU results can differ in the last bits between runs. Elsewhere (CPU, float64):
    its torch fallback, deterministic; it keeps distances and centroid sums in float32 even for float64 input.
    """
    if iters == 0:
        return centroids
    if precision != "tf32x3":
        for _ in range(iters):
            centroids = cluster_means(x, assign(round_operand(x, precision), round_operand(centroids, precision)), centroids)
        return centroids
    P, K, D = centroids.shape
    if x.is_cuda and x.dtype != torch.float64:
        from flash_kmeans import batch_kmeans_Euclid as run
    else:
        from flash_kmeans.torch_fallback import batch_kmeans_Euclid_torch_native as run
    _, result, _ = run(x.contiguous(), K, max_iters=iters, tol=0.0, init_centroids=centroids.contiguous())
    return result.to(x.dtype)


def round_operand(v: torch.Tensor, precision: KMeansPrecision) -> torch.Tensor:
    """``v`` rounded to nearest-even bf16 or TF32 (10 explicit mantissa bits), in its own dtype."""
    if precision == "bf16":
        return v.to(torch.bfloat16).to(v.dtype)
    if precision != "tf32":
        raise ValueError(f"unknown k-means precision {precision!r}; use 'tf32x3', 'tf32' or 'bf16'")
    bits = v.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # the float32 bits, unsigned
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32).to(v.dtype)


def cluster_means(x: torch.Tensor, ids: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The mean of the points of ``x`` [P, N, D] in each cluster of ``ids`` [P, N]; empty clusters keep ``old``."""
    P, K, D = old.shape
    flat = (ids + K * torch.arange(P, device=x.device).unsqueeze(1)).flatten()
    sums = x.new_zeros(P * K, D).index_add_(0, flat, x.reshape(-1, D)).view(P, K, D)
    counts = torch.bincount(flat, minlength=P * K).view(P, K, 1)
    return torch.where(counts > 0, sums / counts.clamp_min(1).to(x.dtype), old)
