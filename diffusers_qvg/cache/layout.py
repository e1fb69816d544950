"""Where every resident chunk of a layer lives: the bookkeeping all layers share, kept apart from tensors.

All layers of a transformer write the same chunks, so one :class:`ChunkLayout` describes every layer's
storage. :meth:`ChunkLayout.plan` validates a forward's chunk and returns the next layout plus the tensor
moves it implies (a finished chunk into the sink, recent chunks into the packed pool);
:meth:`ChunkLayout.finalize` does the same for a clean-context pass under ``commit="final-pass"``, and
:meth:`ChunkLayout.rewound` opens a re-cache. None mutates ``self``, so every error is raised before any
state changes.
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
    packed ``(block, slot)``. ``slot`` is ``None`` while a chunk has no storage (``commit="final-pass"``: the
    chunk being denoised, and a chunk of the clean-context pass until its moves are planned)."""

    start_frame: int
    frames: int
    tokens: int
    place: Place
    slot: int | None
    block: int = -1

    @property
    def end_frame(self) -> int:
        return self.start_frame + self.frames


@dataclass(frozen=True)
class ToSink:
    """Copy a finished chunk from its ring slot (``None``: the K/V of this forward) into the sink storage."""

    ring_slot: int | None
    sink_slot: int
    token_start: int
    tokens: int


@dataclass(frozen=True)
class Pack:
    """Pack a chunk from its ring slot (``None``: the K/V of this forward) into packed ``(block, slot)``,
    optionally warm-started from ``warm``."""

    ring_slot: int | None
    block: int
    slot: int
    tokens: int
    warm: tuple[int, int] | None


@dataclass(frozen=True)
class ToRing:
    """Write the K/V of this forward into ring ``slot`` (a clean-context pass keeping its chunk recent)."""

    slot: int
    tokens: int


Move = ToSink | Pack | ToRing


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
    next_frame: int = 0  # where the next chunk starts: the end of the newest chunk

    # Derived sizes, one definition each.
    @property
    def tokens_per_frame(self) -> int:
        return self.height * self.width

    @property
    def slot_tokens(self) -> int:
        return self.slot_frames * self.tokens_per_frame

    @property
    def ring_slots(self) -> int:
        return self.config.keep_recent_chunks + self.config.current_slots

    @property
    def started(self) -> bool:
        return self.slot_frames > 0

    @property
    def current(self) -> Chunk | None:
        """The chunk being denoised (``None`` between chunks under ``commit="final-pass"``)."""
        return self.chunks[-1] if self.chunks and self.chunks[-1].place == "current" else None

    def check_start(self, start_frame: int, final: bool = False) -> None:
        """A forward may rewrite the current chunk or start the next one at :attr:`next_frame`; under
        ``commit="final-pass"`` only after the current chunk's clean-context pass (``final=True``)."""
        if not isinstance(start_frame, int) or start_frame < 0:
            raise ValueError(f"start_frame={start_frame!r} is invalid: use a non-negative latent frame index")
        if not isinstance(final, bool):
            raise ValueError(f"final={final!r} is invalid: use True for the clean-context pass, else False")
        cur = self.current
        if not self.started or start_frame == (cur.start_frame if cur is not None else self.next_frame):
            return
        if self.config.commit == "on-advance":
            if start_frame == self.next_frame:
                return
            raise ValueError(
                f"chunk at frame {start_frame} is neither the current chunk (frame {cur.start_frame}, a rewrite) "
                f"nor the next one (frame {cur.end_frame}, an advance); chunks must be written in order. Call "
                "cache.reset() to start a new video"
            )
        if cur is not None and start_frame == self.next_frame:
            raise ValueError(
                f"the chunk at frame {cur.start_frame} never had its final pass, so its K/V were never stored "
                f"(commit='final-pass'); run its clean-context pass inside `cache.chunk(start_frame="
                f"{cur.start_frame}, final=True)` before starting frame {start_frame}, or enable the cache with "
                "commit='on-advance' (every forward stores the chunk)"
            )
        if cur is None and start_frame < self.next_frame:
            raise ValueError(
                f"chunk at frame {start_frame} already had its final pass: its K/V are stored and cannot be "
                f"rewritten (commit='final-pass'); the next chunk starts at frame {self.next_frame}. Call "
                "cache.reset() to start a new video"
            )
        expected = cur.start_frame if cur is not None else self.next_frame
        raise ValueError(
            f"chunk at frame {start_frame} is not the next chunk to write (frame {expected}); chunks must be "
            "written in order. Call cache.reset() to start a new video"
        )

    def plan(self, start_frame: int, frames: int, height: int, width: int) -> tuple["ChunkLayout", list[Move]]:
        """Validate a forward over ``frames`` post-patch frames of ``height x width`` at ``start_frame``."""
        self.check_start(start_frame)
        cur = self.current
        if cur is not None and start_frame == cur.start_frame:
            if (frames, height, width) != (cur.frames, self.height, self.width):
                raise ChunkRewriteSizeError(0, start_frame, cur.tokens, frames * height * width)
            return self, []
        if self.started and (height, width) != (self.height, self.width):
            raise ValueError(
                f"this chunk has a {height}x{width} patch grid but the cache holds {self.height}x{self.width}; "
                "every chunk of a video needs the same resolution: call cache.reset() for a new one"
            )
        new = copy.deepcopy(self)
        if not self.started:
            new.start(start_frame, frames, height, width)
        new.check_new_chunk(start_frame, frames)
        moves = new.finish_current() if cur is not None else []
        new.evict_for(frames)
        moves += new.pack_overflow()
        slot = new.free_ring_slot() if self.config.current_slots else None
        new.chunks.append(Chunk(start_frame, frames, frames * new.tokens_per_frame, "current", slot))
        new.next_frame = start_frame + frames
        return new, moves

    def finalize(self) -> tuple["ChunkLayout", list[Move]]:
        """The current chunk's clean-context pass (``commit="final-pass"``): the chunk is final at once.

        Its K/V go straight to the sink, a recent ring slot (the oldest recent chunk is packed first to free
        it) or the packed pool; chunks that no next chunk can see (it has at least one frame) are evicted.
        Moves whose source is ``None`` take the K/V of this forward, so each layer carries them out after it
        attended (the window it reads is this layout's).
        """
        new = copy.deepcopy(self)
        chunk = new.chunks[-1]
        moves = new.finish_current()
        new.evict_for(1)
        moves += new.pack_overflow()
        if new.chunks and new.chunks[-1] is chunk and chunk.place == "recent":
            chunk.slot = new.free_ring_slot()
            moves.append(ToRing(chunk.slot, chunk.tokens))
        return new, moves

    def rewound(self) -> "ChunkLayout":
        """A copy holding only the sink, its next chunk the oldest chunk after the sink: a re-cache
        (``QVGCache.recache``) stores the chunks after the sink again, in order, by clean-context passes.
        Between chunks only (no chunk being denoised)."""
        new = copy.deepcopy(self)
        rest = [c for c in new.chunks if c.place != "sink"]
        if rest:
            new.next_frame = rest[0].start_frame
        new.chunks = [c for c in new.chunks if c.place == "sink"]
        return new

    # The steps of an advance, applied to a copy by ``plan`` (and ``finalize``).
    def start(self, start_frame: int, frames: int, height: int, width: int) -> None:
        self.origin_frame, self.height, self.width = start_frame, height, width
        self.slot_frames = self.config.chunk_frames or frames
        history = self.max_resident_history()
        self.block_slots = UNBOUNDED_BLOCK_CHUNKS if history is None else max(1, history - self.config.keep_recent_chunks)

    def max_resident_history(self) -> int | None:
        """Most finished non-sink chunks of ``slot_frames`` resident at once; ``None``: no bound is known.

        With a window, they sit beside the current chunk (``"on-advance"``) or before a next chunk of at least
        one frame (``"final-pass"``). With ``expected_frames``, every chunk of the stream, the current one
        excepted under ``"on-advance"``.
        """
        cfg, s = self.config, self.slot_frames
        bounds = []
        if cfg.window_frames is not None:
            reserved = s if cfg.current_slots else 1
            bounds.append((cfg.window_frames - cfg.sink_frames - reserved) // s)
        if cfg.expected_frames is not None:
            bounds.append(-(-(cfg.expected_frames - cfg.sink_frames) // s) - cfg.current_slots)
        return min(bounds) if bounds else None

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

    def finish_current(self) -> list[Move]:
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

    def free_ring_slot(self) -> int:
        used = {c.slot for c in self.chunks if c.place in ("current", "recent")}
        return min(set(range(self.ring_slots)) - used)
