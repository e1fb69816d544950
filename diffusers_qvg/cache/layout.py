"""Where every resident chunk of a layer lives: the bookkeeping all layers share, kept apart from tensors.

All layers of a transformer write the same chunks, so one :class:`ChunkLayout` describes every layer's
storage. :meth:`ChunkLayout.plan` validates a forward's chunk and returns the next layout plus the tensor
moves it implies (a finished chunk into the sink, recent chunks into the packed pool); it never mutates
``self``, so every error is raised before any state changes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Literal

from .config import CacheConfig
from .errors import ChunkRewriteSizeError

Place = Literal["current", "recent", "sink", "packed"]

# Packed-pool slots per storage block when the history is unbounded (a block is added when all are full).
UNBOUNDED_BLOCK_CHUNKS = 8


@dataclass
class Chunk:
    """A chunk of consecutive latent frames and its place: a ring slot (current/recent), a sink slot, or a
    packed ``(block, slot)``."""

    start_frame: int
    frames: int
    tokens: int
    place: Place
    slot: int
    block: int = -1

    @property
    def end_frame(self) -> int:
        return self.start_frame + self.frames


@dataclass(frozen=True)
class ToSink:
    """Copy a finished chunk from its ring slot into the sink storage."""

    ring_slot: int
    sink_slot: int
    token_start: int
    tokens: int


@dataclass(frozen=True)
class Pack:
    """Pack a chunk from its ring slot into packed ``(block, slot)``, optionally warm-started from ``warm``."""

    ring_slot: int
    block: int
    slot: int
    tokens: int
    warm: tuple[int, int] | None


@dataclass
class ChunkLayout:
    config: CacheConfig
    chunks: list[Chunk] = field(default_factory=list)
    origin_frame: int = 0
    height: int = 0
    width: int = 0
    slot_frames: int = 0
    block_slots: int = 0
    num_blocks: int = 0

    # Derived sizes, one definition each.
    @property
    def tokens_per_frame(self) -> int:
        return self.height * self.width

    @property
    def slot_tokens(self) -> int:
        return self.slot_frames * self.tokens_per_frame

    @property
    def ring_slots(self) -> int:
        return self.config.keep_recent_chunks + 1

    @property
    def current(self) -> Chunk | None:
        return self.chunks[-1] if self.chunks else None

    def expected_starts(self) -> tuple[int, ...]:
        """Start frames a chunk may have now: the current chunk's (rewrite) or its end (advance)."""
        cur = self.current
        return () if cur is None else (cur.start_frame, cur.end_frame)

    def check_start(self, start_frame: int) -> None:
        if not isinstance(start_frame, int) or start_frame < 0:
            raise ValueError(f"start_frame={start_frame!r} is invalid: use a non-negative latent frame index")
        starts = self.expected_starts()
        if starts and start_frame not in starts:
            raise ValueError(
                f"chunk at frame {start_frame} is neither the current chunk (frame {starts[0]}, a rewrite) nor "
                f"the next one (frame {starts[1]}, an advance); chunks must be written in order. Call "
                "cache.reset() to start a new video"
            )

    def plan(
        self, start_frame: int, frames: int, height: int, width: int
    ) -> tuple["ChunkLayout", list[ToSink | Pack]]:
        """Validate a forward over ``frames`` post-patch frames of ``height x width`` at ``start_frame``."""
        self.check_start(start_frame)
        cur = self.current
        if cur is not None and start_frame == cur.start_frame:
            if (frames, height, width) != (cur.frames, self.height, self.width):
                raise ChunkRewriteSizeError(0, start_frame, cur.tokens, frames * height * width)
            return self, []
        if cur is not None and (height, width) != (self.height, self.width):
            raise ValueError(
                f"this chunk has a {height}x{width} patch grid but the cache holds {self.height}x{self.width}; "
                "every chunk of a video needs the same resolution: call cache.reset() for a new one"
            )
        new = copy.deepcopy(self)
        if cur is None:
            new.start(start_frame, frames, height, width)
        new.check_new_chunk(start_frame, frames)
        moves = new.finish_current() if cur is not None else []
        new.evict_for(frames)
        moves += new.pack_overflow()
        used = {c.slot for c in new.chunks if c.place in ("current", "recent")}
        ring_slot = min(set(range(new.ring_slots)) - used)
        new.chunks.append(Chunk(start_frame, frames, frames * new.tokens_per_frame, "current", ring_slot))
        return new, moves

    # The steps of an advance, applied to a copy by ``plan``.
    def start(self, start_frame: int, frames: int, height: int, width: int) -> None:
        cfg = self.config
        self.origin_frame, self.height, self.width = start_frame, height, width
        self.slot_frames = cfg.chunk_frames or frames
        if cfg.window_frames is None:
            self.block_slots = UNBOUNDED_BLOCK_CHUNKS
        else:
            visible_chunks = (cfg.window_frames - cfg.sink_frames) // self.slot_frames
            self.block_slots = max(1, visible_chunks - self.ring_slots)

    def check_new_chunk(self, start_frame: int, frames: int) -> None:
        cfg = self.config
        if frames > self.slot_frames:
            raise ValueError(
                f"a chunk of {frames} frames does not fit the cache's {self.slot_frames}-frame slots (sized by "
                f"the first chunk); pass chunk_frames={frames} (the largest chunk) when enabling the cache"
            )
        sink_end = self.origin_frame + cfg.sink_frames
        if start_frame < sink_end < start_frame + frames:
            raise ValueError(
                f"sink_frames={cfg.sink_frames} ends inside the chunk of frames [{start_frame}, "
                f"{start_frame + frames}); choose sink_frames on a chunk boundary"
            )
        if cfg.window_frames is not None and start_frame >= sink_end and cfg.sink_frames + frames > cfg.window_frames:
            raise ValueError(
                f"window_frames={cfg.window_frames} cannot hold sink_frames={cfg.sink_frames} plus a chunk of "
                f"{frames} frames; enlarge the window"
            )

    def finish_current(self) -> list[ToSink | Pack]:
        """The current chunk is final: it joins the sink (if it lies in the sink frames) or the recent chunks."""
        cur = self.chunks[-1]
        if cur.end_frame > self.origin_frame + self.config.sink_frames:
            cur.place = "recent"
            return []
        sink_slot = sum(c.place == "sink" for c in self.chunks)
        move = ToSink(cur.slot, sink_slot, (cur.start_frame - self.origin_frame) * self.tokens_per_frame, cur.tokens)
        cur.place, cur.slot = "sink", sink_slot
        return [move]

    def evict_for(self, frames: int) -> None:
        """Drop the oldest non-sink chunks until the window holds the sink, the rest, and ``frames`` more."""
        window = self.config.window_frames
        if window is None:
            return
        while self.config.sink_frames + sum(c.frames for c in self.chunks if c.place != "sink") + frames > window:
            oldest = next(i for i, c in enumerate(self.chunks) if c.place != "sink")
            del self.chunks[oldest]

    def pack_overflow(self) -> list[Pack]:
        """Pack the oldest recent chunks beyond ``keep_recent_chunks`` into free packed slots."""
        moves = []
        recent = [c for c in self.chunks if c.place == "recent"]
        for chunk in recent[: max(0, len(recent) - self.config.keep_recent_chunks)]:
            packed = [c for c in self.chunks if c.place == "packed"]
            used = {(c.block, c.slot) for c in packed}
            free = [(b, s) for b in range(self.num_blocks) for s in range(self.block_slots) if (b, s) not in used]
            if not free:
                free = [(self.num_blocks, 0)]
                self.num_blocks += 1
            warm = (packed[-1].block, packed[-1].slot) if self.config.warm_start and packed else None
            moves.append(Pack(chunk.slot, *free[0], chunk.tokens, warm))
            chunk.place, (chunk.block, chunk.slot) = "packed", free[0]
        return moves
