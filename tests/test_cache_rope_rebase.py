"""Streams past the transformer's RoPE table: the window's positions are re-based, the sink keeps its place.

Keys are cached before RoPE and rotated as they are read, so a re-based window costs no re-encode; a model
whose table is long enough, told to re-base at the same frame (``rope_frames``), gives the same video.
"""


import pytest
import torch
from test_cache import assert_unchanged, snapshot
from wan_helpers import HEIGHT, WIDTH, tiny_wan

import diffusers_qvg as dq
from diffusers_qvg.cache.layout import ChunkLayout
from diffusers_qvg.cache.plan import window_positions

FINAL = dict(commit="final-pass")
WINDOW = dict(window_frames=8, sink_frames=2)
TEXT = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


def layout_at(next_frame, frames=2, **options):
    """The layout planning the chunk at ``next_frame`` after the chunks before it had their final pass."""
    layout = ChunkLayout(dq.CacheConfig(**WINDOW, **FINAL, **options))
    for start in range(0, next_frame + 1, frames):
        layout, _ = layout.plan(start, frames, 2, 2)
        if start < next_frame:
            layout, _ = layout.finalize()
    return layout


def frame_positions(layout, table):
    return window_positions(layout, table)


def test_positions_are_frames_until_the_table_ends_then_the_window_moves_back_behind_the_sink():
    assert frame_positions(layout_at(8), 16) == [0, 1, 4, 5, 6, 7, 8, 9]  # sink, two chunks, the current one
    assert frame_positions(layout_at(14), 16) == [0, 1, 10, 11, 12, 13, 14, 15]  # the last frame fits
    # past the table: the chunks after the sink keep their spacing, the newest frame on the last position
    for start in (16, 18, 38):
        assert frame_positions(layout_at(start), 16) == [0, 1, 10, 11, 12, 13, 14, 15]
    assert frame_positions(layout_at(38, rope_frames=12), 16) == [0, 1, 6, 7, 8, 9, 10, 11]


def run(model, cache, chunks, frames=2, seed=0, first=0):
    """Per chunk from chunk ``first`` on, a denoising forward and the clean-context pass; every output."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    for c in range(first, first + chunks):
        for t in (500.0, 0.0):
            x = torch.randn(1, 16, frames, HEIGHT, WIDTH, generator=g, dtype=torch.float64)
            with cache.chunk(start_frame=c * frames, final=t == 0.0):
                outs.append(model(x, torch.tensor([t], dtype=torch.float64), TEXT).sample)
    return outs


@torch.no_grad()
@pytest.mark.parametrize("storage, commit", [("bf16", "final-pass"), ("bf16", "on-advance")], ids=["final-pass", "on-advance"])
def test_a_16_frame_table_streams_40_frames_like_a_long_table_at_the_same_positions(storage, commit):
    short = tiny_wan(rope_max_seq_len=16)
    long, plain = tiny_wan(rope_max_seq_len=64), tiny_wan(rope_max_seq_len=64)
    options = dict(storage=storage, commit=commit, **WINDOW)
    outs = [
        run(short, dq.enable_qvg(short, **options), 20),
        run(long, dq.enable_qvg(long, rope_frames=16, **options), 20),
        run(plain, dq.enable_qvg(plain, **options), 20),  # never re-based: global positions up to 39
    ]
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
    same = [torch.equal(a, b) for a, b in zip(outs[0], outs[2])]
    assert all(same[:16]) and not any(same[16:])  # 2 forwards per chunk: the chunks ending by frame 16 agree


@torch.no_grad()
def test_keys_stored_after_rope_are_refused_past_the_table_before_anything_changes():
    model = tiny_wan(rope_max_seq_len=16)
    cache = dq.enable_qvg(model, "bf16", keys_before_rope=False, **WINDOW, **FINAL)
    run(model, cache, 8)  # frames 0-15: within the table
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"ending at frame 18 runs past the 16 RoPE positions.*keys_before_rope=False"):
        with cache.chunk(start_frame=16):
            model(torch.zeros(1, 16, 2, HEIGHT, WIDTH, dtype=torch.float64), torch.tensor([500.0]), TEXT)
    assert_unchanged(cache, before)


@torch.no_grad()
@pytest.mark.parametrize(
    "options, match",
    [
        (dict(), r"frames 2 to 17 are visible after the sink but RoPE has 16 positions.*window_frames <= 16"),
        (dict(window_frames=20), r"window_frames <= 16"),
        (dict(window_frames=8, rope_frames=32), r"rope_frames=32 exceeds the transformer's rope_max_seq_len=16"),
    ],
)
def test_a_window_the_table_cannot_hold_is_refused_with_its_fix_before_anything_changes(options, match):
    model = tiny_wan(rope_max_seq_len=16)
    cache = dq.enable_qvg(model, "bf16", sink_frames=2, **options, **FINAL)
    chunks = 0 if "rope_frames" in options else 8
    run(model, cache, chunks)
    before = snapshot(cache) if chunks else None
    with pytest.raises(ValueError, match=match):
        run(model, cache, 1, first=chunks)
    if before is not None:
        assert_unchanged(cache, before)
