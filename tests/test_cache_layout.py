"""Chunk bookkeeping without tensors: placement, eviction, slot reuse, pool growth, warm-start sources."""

import pytest

from diffusers_qvg import CacheConfig, ChunkRewriteSizeError
from diffusers_qvg.cache.layout import UNBOUNDED_BLOCK_CHUNKS, ChunkLayout, Pack, ToSink


def advance(layout, chunks, frames=3):
    moves = []
    for _ in range(chunks):
        start = layout.current.end_frame if layout.current else 0
        layout, step = layout.plan(start, frames, 2, 2)
        moves.append(step)
    return layout, moves


def test_self_forcing_window_with_sink_packs_once_and_reuses_slots():
    layout, moves = advance(ChunkLayout(CacheConfig(window_frames=12, sink_frames=3)), 8)
    assert [(c.start_frame, c.place) for c in layout.chunks] == [(0, "sink"), (15, "packed"), (18, "recent"), (21, "current")]
    assert moves[1] == [ToSink(ring_slot=0, sink_slot=0, token_start=0, tokens=12)]
    packs = [m for step in moves for m in step if isinstance(m, Pack)]
    assert [(p.block, p.slot) for p in packs] == [(0, 0)] * len(packs)  # one packed slot, reused
    assert layout.num_blocks == 1 and layout.block_slots == 1
    assert {c.slot for c in layout.chunks if c.place in ("recent", "current")} == {0, 1}


def test_unbounded_history_grows_by_whole_blocks_and_warm_starts_from_the_newest_packed_chunk():
    layout, moves = advance(ChunkLayout(CacheConfig(warm_start=True)), UNBOUNDED_BLOCK_CHUNKS + 3)
    packs = [m for step in moves for m in step]
    assert layout.num_blocks == 2
    assert [(p.block, p.slot) for p in packs][-2:] == [(0, UNBOUNDED_BLOCK_CHUNKS - 1), (1, 0)]
    assert packs[0].warm is None and packs[-1].warm == (0, UNBOUNDED_BLOCK_CHUNKS - 1)


def test_plan_never_mutates_the_layout_it_was_asked():
    layout, _ = advance(ChunkLayout(CacheConfig(window_frames=9)), 4)
    before = [vars(c).copy() for c in layout.chunks]
    layout.plan(layout.current.end_frame, 3, 2, 2)
    with pytest.raises(ChunkRewriteSizeError):
        layout.plan(layout.current.start_frame, 2, 2, 2)
    with pytest.raises(ValueError, match="resolution"):
        layout.plan(layout.current.end_frame, 3, 4, 2)
    assert [vars(c) for c in layout.chunks] == before


def test_rewrite_returns_the_same_layout_and_no_moves():
    layout, _ = advance(ChunkLayout(CacheConfig()), 2)
    assert layout.plan(layout.current.start_frame, 3, 2, 2) == (layout, [])
