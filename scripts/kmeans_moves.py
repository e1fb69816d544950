"""The share of tokens each Lloyd assignment moves to another cluster, on video-derived K and V.

The Triton encoder's updates after the first gather only the tokens whose id changed (docs/benchmarks.md, "The
encoder's memory traffic"), so their cost follows these shares. The k-means is the reference encoder's own at
the default ``QVGConfig()``: strided init, bf16 assignments, 256 centroids per head.

    python scripts/kmeans_moves.py            # Self-Forcing geometry, 2 chunks, ~20 s on a CPU
    python scripts/kmeans_moves.py --small    # tiny sizes, seconds
"""

from __future__ import annotations

import argparse

import torch

import diffusers_qvg as dq
from diffusers_qvg.codecs.qvg.kmeans import assign, cluster_means, kmeans_init, round_operand
from diffusers_qvg.video_kv import VideoKVSpec, video_kv


def moved_shares(x: torch.Tensor, config: dq.QVGConfig) -> list[float]:
    """For points ``x`` [P, N, D]: the share of tokens whose id changes at assignments 2, 3, ... of
    ``config``'s k-means (its init, centroids, iterations and precision)."""
    centroids = kmeans_init(x, config.centroids, config.kmeans_init, torch.Generator().manual_seed(config.seed))
    shares, previous = [], None
    for _ in range(config.kmeans_iters):
        ids = assign(round_operand(x, config.kmeans_precision), round_operand(centroids, config.kmeans_precision))
        if previous is not None:
            shares.append((ids != previous).float().mean().item())
        centroids, previous = cluster_means(x, ids, centroids), ids
    return shares


def main(argv: list[str] | None = None) -> dict[str, list[list[float]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--small", action="store_true", help="tiny sizes")
    parser.add_argument("--chunks", type=int, default=2)
    args = parser.parse_args(argv)
    spec = VideoKVSpec(height=32, width=48, patch=8, heads=2, head_dim=64) if args.small else VideoKVSpec()
    config = dq.QVGConfig(num_centroids=16) if args.small else dq.QVGConfig()
    data = video_kv(spec, chunks=args.chunks)
    n = spec.tokens_per_chunk
    result = {}
    for name, t in (("K before RoPE", data.key_pre_rope), ("V", data.value)):
        result[name] = []
        for c in range(args.chunks):
            x = t[:, c * n:(c + 1) * n].float().permute(0, 2, 1, 3).reshape(-1, n, t.shape[-1])
            result[name].append(moved_shares(x, config))
            shares = ", ".join(f"{s:.1%}" for s in result[name][-1])
            print(f"{name}, chunk {c}: tokens moved at assignments 2-{config.kmeans_iters}: {shares}")
    return result


if __name__ == "__main__":
    main()
