"""One layer's K/V storage and its narrow verb, :meth:`LayerCache.update`.

Per layer: a ring of unquantized chunk slots (``keep_recent_chunks`` recent chunks, and the current one
under ``commit="on-advance"``), the sink storage, and blocks of packed storage; the shared
:class:`~.layout.ChunkLayout` says which slot holds which chunk. Storage is allocated on the first write and
reused afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..codecs import CodecConfig, Packed
from .errors import ChunkRewriteSizeError
from .layout import ChunkLayout, Move, ToRing, ToSink
from .window import InPlaceWindow
from . import ops

if TYPE_CHECKING:
    from .cache import QVGCache

KV = tuple[Packed, Packed]
ROLES = ("key", "value")


class LayerCache:
    def __init__(self, owner: "QVGCache", index: int) -> None:
        self.owner = owner
        self.index = index
        self.ring: KV | None = None
        self.sink: KV | None = None
        self.blocks: list[KV] = []
        self.window: InPlaceWindow | None = None  # under CacheConfig.in_place, instead of all of the above
        self.views: tuple[torch.Tensor, torch.Tensor] | None = None  # in place: the window this chunk attends to

    def storages(self) -> list[Packed]:
        parts = [self.ring, self.sink, *self.blocks, None if self.window is None else self.window.storage]
        return [s for kv in parts if kv is not None for s in kv]

    def ensure_window(self, tokens: int) -> None:
        """In-place buffers of at least ``tokens`` tokens (allocated once, grown only past a bound)."""
        if self.window is None or self.window.capacity < tokens:
            storage = self.owner.allocate(self.owner.config.dense, tokens, 1)
            self.window = InPlaceWindow(storage) if self.window is None else self.window.grown(storage)

    def plan_views(self) -> None:
        """In place: the chunk's window as views of the buffers, made when the chunk is planned (so that a
        compiled forward takes them as inputs, as it takes the workspace's views)."""
        self.ensure_window(self.owner.window_capacity())
        W = self.owner.plan.window_tokens
        self.views = tuple(t[:, :W] for t in self.window.tensors)

    def window_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What this forward's read fills: views of the shared workspace [B, W, H, D], or, in place, the
        layer's whole buffers (the read may move chunks beyond the new window's end)."""
        if not self.owner.config.in_place:
            return self.owner.window_views()
        if self.views is None:  # a layer found in this (eager) forward; the others' views come with the plan
            self.plan_views()
        return self.window.tensors

    @torch.no_grad()
    def update(
        self, key: torch.Tensor, rotated_key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the current chunk's K/V [B, n, H, D] (``key`` before RoPE, ``rotated_key`` after) and return
        the keys and values to attend: views of the shared workspace holding sink, history, recent and
        current chunks in token order, keys rotated.

        Under ``commit="final-pass"`` the chunk has no slot: only its clean-context pass stores it, after the
        window is read (the recent chunk it may pack is part of that window). Only tensor work and fixed
        flags are decided here; the reads and writes are :mod:`.ops` (opaque to ``torch.compile``).
        """
        owner = self.owner
        owner.require_plan()
        owner.ensure_geometry(key)
        keys, values = self.window_views()
        stored = key if owner.config.keys_before_rope else rotated_key
        if owner.config.current_slots:  # "on-advance": every forward rewrites the chunk's ring slot
            ops.store(self, stored, value, keys)
        ops.read_window(self, keys, values, rotated_key, value)
        if owner.commit is not None:  # the clean-context pass stores the chunk where it now belongs
            owner.commit_layer(self, stored, value, keys)
        return self.views if owner.config.in_place else (keys, values)

    def check(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """The forward's K/V against the plan and the cache's geometry, before anything is read or written."""
        owner = self.owner
        plan = owner.require_plan()
        if key.shape != value.shape or key.dim() != 4:
            raise ValueError(
                f"layer {self.index}: keys and values must share one shape [batch, tokens, heads, head_dim], "
                f"got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        if key.shape[1] != plan.current_tokens:
            raise ChunkRewriteSizeError(self.index, owner.layout.current.start_frame, plan.current_tokens, key.shape[1])
        owner.check_geometry(key, value, what=f"layer {self.index}")
        # No finiteness check here: it would synchronise the device in every layer. Writes are checked on
        # the device (the cache's WriteStatus), read once per chunk block.

    def read(self, keys: torch.Tensor, values: torch.Tensor, rotated_key: torch.Tensor, value: torch.Tensor) -> None:
        """Decode every visible chunk into ``keys``/``values`` [B, W, H, D] (keys rotated) and copy the
        current chunk behind them."""
        self.check(rotated_key, value)
        owner, cfg = self.owner, self.owner.config
        plan = owner.plan
        if cfg.in_place:  # the history is already in place; only this forward's chunk is copied behind it
            if self.window.settle((keys, values), owner.planned[0], f"layer {self.index}"):
                owner.block_moved = True  # chunks that left the window were overwritten
            self.window.write((keys, values), owner.layout.current.start_frame, plan.current_start, rotated_key, value)
            return
        rotary = plan.rotary if cfg.keys_before_rope else None
        reads = [(cfg.sink_storage, self.sink, plan.sink), (cfg.dense, self.ring, plan.recent)]
        reads += [(cfg.storage, self.blocks[b], table) for b, table in plan.packed]
        for codec, kv, table in reads:
            if table is not None:  # K and V of a storage in one call (one launch for QVG's kernel)
                codec.dequantize_pair_into(kv[0], kv[1], table, keys, values, rotary=rotary)
        end = plan.current_start + value.shape[1]
        keys[:, plan.current_start : end].copy_(rotated_key)
        values[:, plan.current_start : end].copy_(value)

    def store(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Rewrite the current chunk's ring slot with the forward's K (as the cache keeps keys) and V
        ("on-advance"; in place, the read already wrote the chunk)."""
        self.check(key, value)
        owner = self.owner
        if not owner.config.in_place:
            self.apply(ToRing(owner.layout.current.slot, owner.layout.current.tokens), owner.layout, (key, value))

    def check_final(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """A clean-context pass's K/V, before its group stores anything: the plan's shapes, one store per
        layer, and (on the device) the fresh K/V wherever no move of theirs checks them as it stores them."""
        self.check(key, value)
        owner = self.owner
        commit = owner.commit
        if self.index in commit.layers_done:
            raise RuntimeError(
                f"layer {self.index} already stored this clean-context pass; run one forward per "
                "cache.chunk(start_frame=..., final=True) block"
            )
        # A bad pass is refused before this layer stores anything (with layer 0: before the cache changes).
        # When every move stores the fresh K/V, their own checked writes see them first; when a move packs
        # a recent chunk (from its ring slot) or nothing is moved (in place, or a chunk no later one can see),
        # the fresh K/V are checked here.
        moves = commit.moves
        fresh = [m for m in moves if getattr(m, "ring_slot", None) is None]  # the moves that store this K/V
        if owner.config.in_place or not moves or len(fresh) < len(moves):
            limits = [self.destination(m).max_abs_input for m in fresh]
            limit = min((v for v in limits if v is not None), default=None)
            for x, role in ((key, "key"), (value, "value")):
                owner.status.check(x, f"layer {self.index}'s {role}s", limit)
                owner.block_writes += 1

    def destination(self, move: Move) -> CodecConfig:
        """The codec that stores ``move``'s chunk."""
        cfg = self.owner.config
        return cfg.dense if isinstance(move, ToRing) else cfg.sink_storage if isinstance(move, ToSink) else cfg.storage

    def ensure_ring(self) -> None:
        if self.ring is None:
            layout = self.owner.layout
            self.ring = self.owner.allocate(self.owner.config.dense, layout.ring_slots * layout.slot_tokens, layout.ring_slots)

    # Moves between storages when a chunk becomes final (see ChunkLayout.plan and ChunkLayout.finalize).
    def apply(
        self, move: Move, layout: ChunkLayout, fresh: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Carry out one move of ``layout``'s plan for this layer alone (:func:`apply_move`)."""
        apply_move([self], move, layout, [fresh])

    def target(
        self, move: Move, layout: ChunkLayout, fresh: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[KV, int, int, tuple[Packed, int] | None, tuple[torch.Tensor, torch.Tensor]]:
        """Where ``move`` writes this layer's chunk and from what: ``(storages, token start, slot, warm
        start, (K, V))``; storage is allocated on the first write."""
        owner, cfg = self.owner, self.owner.config
        if isinstance(move, ToRing):
            self.ensure_ring()
            return self.ring, move.slot * layout.slot_tokens, move.slot, None, fresh
        if move.ring_slot is None:
            chunk = fresh
        else:
            src = move.ring_slot * layout.slot_tokens
            chunk = tuple(self.ring[i].values[:, src : src + move.tokens] for i in range(2))
        if isinstance(move, ToSink):
            if self.sink is None:
                frames = cfg.sink_frames
                self.sink = owner.allocate(cfg.sink_storage, frames * layout.tokens_per_frame, frames)
            return self.sink, move.token_start, move.sink_slot, None, chunk
        while len(self.blocks) <= move.block:
            self.blocks.append(owner.allocate(cfg.storage, layout.block_slots * layout.slot_tokens, layout.block_slots))
        warm = None if move.warm is None else (self.blocks[move.warm[0]], move.warm[1])
        return self.blocks[move.block], move.slot * layout.slot_tokens, move.slot, warm, chunk


@torch.no_grad()
def apply_move(
    layers: list[LayerCache],
    move: Move,
    layout: ChunkLayout,
    fresh: list[tuple[torch.Tensor, torch.Tensor] | None],
) -> None:
    """Carry out one move of ``layout``'s plan in each of ``layers`` (``fresh[i]``: layer i's K as stored
    and V of this forward, the source of moves without a ring slot), the cache adopting ``layout`` once
    every layer has.

    Every write that stores a finished chunk is checked on the device through the cache's write status, in
    layer order, K before V; only the "on-advance" rewrite of the current ring slot is not (its forward's
    input was checked). All layers' writes go in one call of the destination codec: for QVG one launch
    sequence of its batched encoder, whatever the number of layers.
    """
    owner = layers[0].owner
    if isinstance(move, ToRing) and move.slot == getattr(layout.current, "slot", None):
        dst = move.slot * layout.slot_tokens
        for layer, kv in zip(layers, fresh):
            layer.ensure_ring()
            for i in range(2):
                layer.ring[i].values[:, dst : dst + move.tokens].copy_(kv[i])
        return
    items, warm_starts, whats = [], [], []
    for layer, kv in zip(layers, fresh):
        dests, start, slot, warm, chunk = layer.target(move, layout, kv)
        items += [(dests[i], chunk[i], start, slot) for i in range(2)]
        warm_starts += [None if warm is None else (warm[0][i], warm[1]) for i in range(2)]
        whats += [f"layer {layer.index}'s {role}s" for role in ROLES]
    layers[0].destination(move).quantize_batch_into(
        items, roles=ROLES * len(layers), warm_starts=warm_starts, status=owner.status, whats=whats,
        heads=owner.head_slice,
    )  # fmt: skip
    owner.block_writes += len(items)
