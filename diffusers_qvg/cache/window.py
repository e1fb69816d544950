"""One layer's in-place window: BF16 storage with rotated keys kept the way Self-Forcing keeps its cache.

When nothing is quantized and keys are stored after RoPE (``CacheConfig.in_place``), the window a chunk
attends to needs no decoding: the layer keeps sink, history and current chunk in one buffer pair, in token
order, and attention reads views of its front. A forward copies only its own chunk behind the history;
when chunks leave the window, the chunks still visible move forward once (the shift Self-Forcing's local
attention makes), at the layer's first read of the new layout. Nothing else is copied per forward.
"""

from __future__ import annotations

import torch

from ..codecs import Packed
from .layout import ChunkLayout


class InPlaceWindow:
    """The buffers (dense K and V of ``capacity`` tokens) and where each chunk they hold starts."""

    def __init__(self, storage: tuple[Packed, Packed]) -> None:
        self.storage = storage
        self.held: dict[int, int] = {}  # start frame -> token offset in the buffers

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage[0].values, self.storage[1].values

    @property
    def capacity(self) -> int:
        return self.tensors[0].shape[1]

    def grown(self, storage: tuple[Packed, Packed]) -> "InPlaceWindow":
        """The same chunks in larger buffers ``storage`` (a window without a bound outgrew these)."""
        for old, new in zip(self.tensors, (s.values for s in storage)):
            new[:, : old.shape[1]].copy_(old)
        window = InPlaceWindow(storage)
        window.held = dict(self.held)
        return window

    def settle(self, buffers: tuple[torch.Tensor, torch.Tensor], layout: ChunkLayout, what: str) -> bool:
        """Move the chunks of ``layout`` (all but the current one) to their places in its window, in token
        order; chunks not in it are forgotten. Returns whether anything moved.

        ``buffers`` are :attr:`tensors` as the caller passes them (inside a compiled forward, what the opaque
        read op was given: only writes into its arguments count).

        Chunks only leave the window from its front (after the sink), so every chunk moves towards the
        front: copied oldest first, in pieces no longer than the distance moved, no copy reads what an
        earlier one wrote.
        """
        moves, held, dst = [], {}, 0
        for c in layout.chunks:
            if c.place != "current":
                src = self.held.get(c.start_frame)
                if src is None or src < dst:
                    raise RuntimeError(
                        f"{what}: the in-place window does not hold the chunk at frame {c.start_frame} where the "
                        "layout needs it; call cache.reset() and generate the video again"
                    )
                if src != dst:
                    moves.append((src, dst, c.tokens))
                held[c.start_frame] = dst
            dst += c.tokens
        for src, dst, n in moves:
            step = src - dst
            for offset in range(0, n, step):
                m = min(step, n - offset)
                for t in buffers:
                    t[:, dst + offset : dst + offset + m].copy_(t[:, src + offset : src + offset + m])
        self.held = held
        return bool(moves)

    def write(
        self, buffers: tuple[torch.Tensor, torch.Tensor], start_frame: int, dst: int, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """The current chunk (keys rotated) into its place behind the history."""
        for t, x in zip(buffers, (key, value)):
            t[:, dst : dst + x.shape[1]].copy_(x)
        self.held[start_frame] = dst
