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


def window_frame_ids(layout: ChunkLayout) -> torch.Tensor:
    """Global frame index of every visible frame, in window order (oldest chunk first)."""
    return torch.cat([torch.arange(c.start_frame, c.end_frame) for c in layout.chunks])


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
        current_rotary=tuple(t[:, start:dst].clone() for t in rotary),  # a copy: the dense window tables can go
    )
