"""One layer's K/V storage and its narrow verb, :meth:`LayerCache.update`.

Per layer: a ring of unquantized chunk slots (``keep_recent_chunks`` recent chunks, and the current one
under ``commit="on-advance"``), the sink storage, and blocks of packed storage; the shared
:class:`~.layout.ChunkLayout` says which slot holds which chunk. Storage is allocated on the first write and
reused afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..codecs import Packed
from .errors import ChunkRewriteSizeError
from .layout import ChunkLayout, Move, ToRing, ToSink
from .plan import ReadPlan

if TYPE_CHECKING:
    from .cache import QVGCache

KV = tuple[Packed, Packed]


class LayerCache:
    def __init__(self, owner: "QVGCache", index: int) -> None:
        self.owner = owner
        self.index = index
        self.ring: KV | None = None
        self.sink: KV | None = None
        self.blocks: list[KV] = []

    def storages(self) -> list[Packed]:
        parts = [self.ring, self.sink, *self.blocks]
        return [s for kv in parts if kv is not None for s in kv]

    @torch.no_grad()
    def update(
        self, key: torch.Tensor, rotated_key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the current chunk's K/V [B, n, H, D] (``key`` before RoPE, ``rotated_key`` after) and return
        the keys and values to attend: views of the shared workspace holding sink, history, recent and
        current chunks in token order, keys rotated.

        Under ``commit="final-pass"`` the chunk has no slot: only its clean-context pass stores it, after the
        window is read (the recent chunk it may pack is part of that window)."""
        owner = self.owner
        plan, layout = owner.require_plan(), owner.layout
        self.check(key, rotated_key, value, plan.current_tokens, layout.current.start_frame)
        owner.ensure_geometry(key)
        fresh = (key if owner.config.keys_before_rope else rotated_key, value)
        if layout.current.slot is not None:
            self.apply(ToRing(layout.current.slot, layout.current.tokens), layout, fresh)
        window = self.read(plan, rotated_key, value)
        if owner.commit is not None:
            for move in owner.commit.moves:
                self.apply(move, owner.commit.layout, fresh)
            owner.layer_committed(self.index)
        return window

    def check(
        self, key: torch.Tensor, rotated_key: torch.Tensor, value: torch.Tensor, tokens: int, start_frame: int
    ) -> None:
        if not (key.shape == rotated_key.shape == value.shape) or key.dim() != 4:
            raise ValueError(
                f"layer {self.index}: key, rotated key and value must share one shape [batch, tokens, heads, "
                f"head_dim], got {tuple(key.shape)}, {tuple(rotated_key.shape)}, {tuple(value.shape)}"
            )
        if key.shape[1] != tokens:
            raise ChunkRewriteSizeError(self.index, start_frame, tokens, key.shape[1])
        self.owner.check_geometry(key, value, what=f"layer {self.index}")
        # No finiteness check here: it would synchronise the device in every layer. The transformer input is
        # checked once per forward (QVGCache.begin_forward) and the codec checks every chunk it packs.

    def read(self, plan: ReadPlan, rotated_key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        owner, cfg = self.owner, self.owner.config
        B, n, H, D = value.shape
        keys, values = owner.workspace.views((B, plan.window_tokens, H, D))
        rotary = plan.rotary if cfg.keys_before_rope else None
        reads = [(cfg.sink_storage, self.sink, plan.sink), (cfg.dense, self.ring, plan.recent)]
        reads += [(cfg.storage, self.blocks[b], table) for b, table in plan.packed]
        for codec, kv, table in reads:
            if table is not None:
                codec.dequantize_into(kv[0], table, keys, rotary=rotary)
                codec.dequantize_into(kv[1], table, values)
        end = plan.current_start + n
        keys[:, plan.current_start : end].copy_(rotated_key)
        values[:, plan.current_start : end].copy_(value)
        return keys, values

    def ensure_ring(self) -> None:
        if self.ring is None:
            layout = self.owner.layout
            self.ring = self.owner.allocate(self.owner.config.dense, layout.ring_slots * layout.slot_tokens, layout.ring_slots)

    # Moves between storages when a chunk becomes final (see ChunkLayout.plan and ChunkLayout.finalize).
    @torch.no_grad()
    def apply(
        self, move: Move, layout: ChunkLayout, fresh: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Carry out one move of ``layout``'s plan (the cache adopts ``layout`` once every layer has);
        ``fresh`` is this forward's K (as stored) and V, the source of moves without a ring slot."""
        owner, cfg = self.owner, self.owner.config
        if isinstance(move, ToRing):
            self.ensure_ring()
            dst = move.slot * layout.slot_tokens
            for i in range(2):
                self.ring[i].values[:, dst : dst + move.tokens].copy_(fresh[i])
            return
        if move.ring_slot is None:
            chunk = fresh
        else:
            src = move.ring_slot * layout.slot_tokens
            chunk = [self.ring[i].values[:, src : src + move.tokens] for i in range(2)]
        if isinstance(move, ToSink):
            if self.sink is None:
                frames = cfg.sink_frames
                self.sink = owner.allocate(cfg.sink_storage, frames * layout.tokens_per_frame, frames)
            dests, codec, start, slot, warm = self.sink, cfg.sink_storage, move.token_start, move.sink_slot, None
        else:
            while len(self.blocks) <= move.block:
                self.blocks.append(owner.allocate(cfg.storage, layout.block_slots * layout.slot_tokens, layout.block_slots))
            dests, codec, start, slot = self.blocks[move.block], cfg.storage, move.slot * layout.slot_tokens, move.slot
            warm = None if move.warm is None else (self.blocks[move.warm[0]], move.warm[1])
        for i, role in enumerate(("key", "value")):
            codec.quantize_into(
                dests[i],
                chunk[i],
                token_start=start,
                slot=slot,
                role=role,
                warm_start=None if warm is None else warm[0][i],
                warm_slot=0 if warm is None else warm[1],
            )
