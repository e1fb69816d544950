"""A forward's read plan: which segments of which storage land where in the dense window.

Built once per layout change (not per layer, not per denoising step): every layer decodes the same
segments, so the tables and the window's RoPE table are shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs import SegmentTable, segment_table
from .layout import ChunkLayout


@dataclass(frozen=True)
class ReadPlan:
    """Segment tables per storage (``None`` where nothing is read) and the current chunk's window range.

    The tables are built here, once per layout, with their rows on the host and on the device: every
    layer's reads validate against the host rows and never synchronise the device.

    ``rotary`` is the window's ``(cos, sin)`` [1, W, 1, D]; ``current_rotary`` the current chunk's rows of it,
    in tensors of their own (a compiled forward takes them as inputs of a fixed shape).
    """

    sink: SegmentTable | None
    packed: tuple[tuple[int, SegmentTable], ...]
    recent: SegmentTable | None
    current_start: int
    current_tokens: int
    window_tokens: int
    rotary: tuple[torch.Tensor, torch.Tensor]
    current_rotary: tuple[torch.Tensor, torch.Tensor]


def window_frame_ids(layout: ChunkLayout) -> list[int]:
    """Global frame index of every visible frame, in window order (oldest chunk first)."""
    return [f for c in layout.chunks for f in range(c.start_frame, c.end_frame)]


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
        rotary=rotary,
        current_rotary=tuple(t[:, start:dst].clone(memory_format=torch.contiguous_format) for t in rotary),
    )
