"""scripts/kmeans_moves.py: the share of tokens Lloyd's assignments move, which prices the incremental updates."""

import torch
from script_modules import load_script

import diffusers_qvg as dq


def test_separated_clusters_found_at_once_move_nothing_and_video_kv_moves_some():
    moves = load_script("kmeans_moves")
    # 4 tight clusters of 8 tokens in a row: the strided init takes one token of each, so the first assignment
    # is already final.
    g = torch.Generator().manual_seed(0)
    centers = 10 * torch.randn(1, 4, 16, generator=g)
    x = centers.repeat_interleave(8, 1) + 0.01 * torch.randn(1, 32, 16, generator=g)
    assert moves.moved_shares(x, dq.QVGConfig(num_centroids=4)) == [0.0] * 4
    shares = moves.main(["--small"])
    assert set(shares) == {"K before RoPE", "V"} and all(len(chunks) == 2 for chunks in shares.values())
    flat = [s for chunks in shares.values() for chunk in chunks for s in chunk]
    assert len(flat) == 16 and all(0 <= s <= 1 for s in flat) and max(flat) > 0
