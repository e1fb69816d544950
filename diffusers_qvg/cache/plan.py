"""A forward's read plan: which segments of which storage land where in the dense window.

Built once per layout change (not per layer, not per denoising step): every layer decodes the same
segments, so the tables and the window's RoPE table are shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs import SegmentTable, segment_table
from ..rotary import RotaryPairs, rotary_pairs
from .layout import ChunkLayout


@dataclass(frozen=True)
class ReadPlan:
    """Segment tables per storage (``None`` where nothing is read) and the current chunk's window range.

    The tables are built here, once per layout, with their rows on the host and on the device: every
    layer's reads validate against the host rows and never synchronise the device.

    ``rotary`` is the window's RoPE as :class:`~diffusers_qvg.rotary.RotaryPairs` (what every layer's key read
    streams: half the bytes of ``(cos, sin)``); ``current_rotary`` is the current chunk's dense ``(cos, sin)``
    [1, n, 1, D], what the attention processor rotates the chunk's queries and keys with.
    A compiled forward takes ``current_rotary`` as inputs of a fixed shape.
    """

    sink: SegmentTable | None
    packed: tuple[tuple[int, SegmentTable], ...]
    recent: SegmentTable | None
    current_start: int
    current_tokens: int
    window_tokens: int
    rotary: RotaryPairs
    current_rotary: tuple[torch.Tensor, torch.Tensor]

    @property
    def rotary_nbytes(self) -> int:
        return self.rotary.nbytes + sum(t.numel() * t.element_size() for t in self.current_rotary)


def window_positions(layout: ChunkLayout, table_frames: int) -> list[int]:
    """RoPE frame position of every visible frame, in window order (oldest chunk first).

    A frame's position is its global frame index while the newest visible frame fits the RoPE table
    (``table_frames`` positions, the transformer's ``rope_max_seq_len``, or fewer by ``rope_frames``). Past
    it, the window is re-based: every chunk after the sink moves back by the smallest shift that puts the
    newest frame on the table's last position, and the sink keeps its positions in front. Distances within
    the window stay exact; the distance from the sink to the window stops growing. Keys stored before RoPE
    are rotated as they are read, so a new shift re-encodes nothing; keys stored rotated cannot move.
    """
    cfg = layout.config
    limit = table_frames if cfg.rope_frames is None else cfg.rope_frames
    if limit > table_frames:
        raise ValueError(
            f"rope_frames={cfg.rope_frames} exceeds the transformer's rope_max_seq_len={table_frames}; pass "
            f"rope_frames <= {table_frames} or None"
        )
    shift = max(0, layout.next_frame - limit)
    if shift and not cfg.keys_before_rope:
        raise ValueError(
            f"the chunk ending at frame {layout.next_frame} runs past the {limit} RoPE positions, so the window "
            "must be re-based, but this cache stores keys after RoPE (keys_before_rope=False): their positions "
            "were fixed when they were stored, and moving them would decode, un-rotate, re-rotate and re-encode "
            "every cached chunk at every chunk. Use keys_before_rope=True (the default: keys are rotated as "
            "they are read) or a transformer with a larger rope_max_seq_len"
        )
    sink = [c for c in layout.chunks if c.place == "sink"]
    rest = [c for c in layout.chunks if c.place != "sink"]
    if shift and rest and rest[0].start_frame - shift < (sink[-1].end_frame if sink else 0):
        raise ValueError(
            f"frames {rest[0].start_frame} to {layout.next_frame - 1} are visible after the sink but RoPE has "
            f"{limit} positions, too few to re-base them behind the sink; a window of at most {limit} latent "
            f"frames (sink included) fits: pass window_frames <= {limit}"
        )
    return [f for c in sink for f in range(c.start_frame, c.end_frame)] + [
        f - shift for c in rest for f in range(c.start_frame, c.end_frame)
    ]


def build_read_plan(
    layout: ChunkLayout, rotary: tuple[torch.Tensor, torch.Tensor], device: torch.device
) -> ReadPlan:
    sink, packed, recent = [], {}, []
    dst = 0
    for c in layout.chunks:
        if c.place == "sink":
            sink.append(((c.start_frame - layout.origin_frame) * layout.tokens_per_frame, c.tokens, dst, c.slot))
        elif c.place == "packed":
            packed.setdefault(c.block, []).append((c.slot * layout.slot_tokens, c.tokens, dst, c.slot))
        elif c.place == "recent":
            recent.append((c.slot * layout.slot_tokens, c.tokens, dst, c.slot))
        dst += c.tokens

    def table(rows):
        return segment_table(rows, device) if rows else None

    current = layout.current
    start = dst - current.tokens
    return ReadPlan(
        sink=table(sink),
        packed=tuple((block, table(rows)) for block, rows in sorted(packed.items())),
        recent=table(recent),
        current_start=start,
        current_tokens=current.tokens,
        window_tokens=dst,
        rotary=rotary_pairs(*rotary),
        # A copy of its own (the dense window tables can go), contiguous: a compiled forward takes it as an input
        current_rotary=tuple(t[:, start:dst].clone(memory_format=torch.contiguous_format) for t in rotary),
    )
