"""The cache container: per-layer storage, the shared chunk layout, the shared workspace, the chunk verb.

Usage (see :func:`diffusers_qvg.enable_qvg`)::

    cache = diffusers_qvg.enable_qvg(transformer, "qvg-int2", window_frames=21)
    with cache.chunk(start_frame=f):   # every forward inside writes (and reads) the chunk at frame f
        transformer(latents, timestep, prompt_embeds)

A forward at the current chunk's start rewrites it (same size); a forward at its end advances: the previous
chunk becomes final, joins the sink or the recent chunks, the oldest recent chunk is packed, and chunks
that left the window are evicted. Classifier-free guidance: run both branches as one batch (the cache's
batch is the forward's batch, fixed at the first write); separate branch calls would rewrite each other.

With ``commit="final-pass"`` the denoising forwards store nothing, and the clean-context pass says so::

    cache = diffusers_qvg.enable_qvg(transformer, "qvg-int2", commit="final-pass")
    for t in denoising_timesteps:
        with cache.chunk(start_frame=f):              # attends to the cache and its own K/V, stores nothing
            transformer(noisy_latents, t, prompt_embeds)
    with cache.chunk(start_frame=f, final=True):      # stores the chunk: sink, recent slot or packed pool
        transformer(clean_latents, 0, prompt_embeds)
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..codecs import CodecConfig, Packed
from ..rope_offset import wan_rope_for_frames
from ..rotary import compute_dtype_for
from .config import CacheConfig
from .layer import LayerCache
from .layout import ChunkLayout, Move
from .memory import MemoryReport
from .plan import ReadPlan, build_read_plan, window_frame_ids
from .workspace import Workspace


@dataclass
class Commit:
    """A clean-context pass in flight: every layer carries out ``moves`` after attending; then the cache
    adopts ``layout``."""

    layout: ChunkLayout
    moves: list[Move]
    layers_done: set[int] = field(default_factory=set)


class QVGCache:
    """KV cache of a transformer's self-attention layers for chunk-by-chunk generation (inference only)."""

    def __init__(self, config: CacheConfig, num_layers: int, guard: Callable[[], None] | None = None) -> None:
        """``guard`` runs at every :meth:`chunk` (the installer refuses block-skipping caches there)."""
        self.config = config
        self.layers = [LayerCache(self, i) for i in range(num_layers)]
        self.workspace = Workspace()
        self.guard = guard
        self.active_start: int | None = None
        self.active_final = False
        self.reset()

    @property
    def active(self) -> bool:
        return self.active_start is not None

    def reset(self) -> None:
        """Forget every chunk and free all storage (the next video starts at any frame)."""
        if self.active:
            raise RuntimeError("cache.reset() inside an active cache.chunk(...) block; reset between chunks")
        self.layout = ChunkLayout(self.config)
        self.geometry: tuple[int, int, int, torch.dtype, torch.device] | None = None
        self.plan: ReadPlan | None = None
        self.planned: tuple[ChunkLayout, ReadPlan] | None = None
        self.commit: Commit | None = None
        self.interrupted: str | None = None
        for layer in self.layers:
            layer.ring, layer.sink, layer.blocks = None, None, []
        self.workspace.release()

    @contextmanager
    def chunk(self, start_frame: int, final: bool = False) -> Iterator["QVGCache"]:
        """Forwards inside write the chunk starting at latent frame ``start_frame`` and attend to the cache.

        ``final=True`` marks the chunk's clean-context pass: under ``commit="final-pass"`` its one forward
        stores the chunk for good; under ``"on-advance"`` it changes nothing (the next chunk makes it final).
        """
        if self.active:
            raise RuntimeError(f"a chunk at frame {self.active_start} is already active; chunk blocks do not nest")
        if self.interrupted is not None:
            raise RuntimeError(self.interrupted)
        self.layout.check_start(start_frame, final)
        if self.guard is not None:
            self.guard()
        self.active_start, self.active_final, self.plan = start_frame, final, None
        try:
            yield self
        finally:
            if self.commit is not None and self.commit.layers_done:
                self.interrupted = (
                    f"the clean-context pass of the chunk at frame {start_frame} stopped after "
                    f"{len(self.commit.layers_done)} of {len(self.layers)} layers stored it, so the layers disagree; "
                    "call cache.reset() and generate the video again"
                )
            self.active_start, self.active_final, self.plan, self.commit = None, False, None, None

    def begin_forward(
        self, rope: torch.nn.Module, hidden_states: torch.Tensor, frames: int, height: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Called once per transformer forward (by the RoPE hook): rewrite or advance, then plan the reads.

        Returns the chunk's RoPE ``(cos, sin)`` at its global frame positions.
        """
        if self.commit is not None and self.commit.layers_done:
            raise RuntimeError(
                "the previous forward stopped part-way through its clean-context pass; leave the cache.chunk(...) "
                "block, call cache.reset() and generate the video again"
            )
        layout, moves = self.layout.plan(self.active_start, frames, height, width)
        if self.geometry is not None:
            B, _, _, _, device = self.geometry
            if hidden_states.shape[0] != B or hidden_states.device != device:
                raise ValueError(
                    f"this forward has batch {hidden_states.shape[0]} on {hidden_states.device} but the cache holds "
                    f"batch {B} on {device}; keep batch and device fixed for a video (batch both CFG branches) "
                    "or call cache.reset()"
                )
        if not bool(torch.isfinite(hidden_states).all()):
            raise ValueError("the transformer input contains NaN or Inf; nothing was cached")
        if self.planned is None or self.planned[0] is not layout:
            # Held in the compute dtype (float32; float64 for float64 models): half the bytes every layer's
            # read rotates with, and no float64 arithmetic on the GPU.
            dtype = compute_dtype_for(hidden_states.dtype)
            rotary = tuple(t.to(dtype) for t in wan_rope_for_frames(rope, window_frame_ids(layout), height, width))
            self.planned = (layout, build_read_plan(layout, rotary, hidden_states.device))
        final = self.active_final and self.config.commit == "final-pass"
        commit = Commit(*layout.finalize()) if final else None
        for move in moves:
            for layer in self.layers:
                layer.apply(move, layout)
        self.layout = layout
        self.plan = self.planned[1]
        self.commit = commit
        if self.geometry is not None:
            self.reserve_workspace()
        return self.plan.current_rotary

    def layer_committed(self, index: int) -> None:
        """Layer ``index`` stored its part of the clean-context pass; once all have, the chunk is final."""
        self.commit.layers_done.add(index)
        if len(self.commit.layers_done) == len(self.layers):
            self.layout, self.commit = self.commit.layout, None

    def require_plan(self) -> ReadPlan:
        if self.plan is None:
            raise RuntimeError(
                "no cached forward is in progress: run the transformer inside `with cache.chunk(start_frame=...)` "
                "on a transformer prepared by diffusers_qvg.enable_qvg (its RoPE hook starts each forward)"
            )
        return self.plan

    # Geometry: batch, heads, head_dim, dtype and device are fixed by the first write after a reset.
    def check_geometry(self, key: torch.Tensor, value: torch.Tensor, what: str) -> None:
        if key.dtype != value.dtype or key.device != value.device:
            raise ValueError(f"{what}: keys ({key.dtype}, {key.device}) and values ({value.dtype}, {value.device}) differ")
        if self.geometry is None:
            return
        B, H, D, dtype, device = self.geometry
        b, _, h, d = key.shape
        if (b, h, d) != (B, H, D):
            raise ValueError(
                f"{what}: batch/heads/head_dim {(b, h, d)} differ from the cache's {(B, H, D)}; every layer and "
                "chunk of a video must share them (call cache.reset() for a different model or batch)"
            )
        if key.dtype != dtype or key.device != device:
            raise ValueError(
                f"{what}: K/V are {key.dtype} on {key.device} but the cache holds {dtype} on {device}; run the "
                "whole video in one dtype and device, or call cache.reset()"
            )

    def ensure_geometry(self, key: torch.Tensor) -> None:
        if self.geometry is None:
            B, _, H, D = key.shape
            self.geometry = (B, H, D, key.dtype, key.device)
            self.reserve_workspace()

    def reserve_workspace(self) -> None:
        B, H, D, dtype, device = self.geometry
        layout, cfg = self.layout, self.config
        if cfg.window_frames is not None:
            tokens = cfg.window_frames * layout.tokens_per_frame
        else:  # sink, packed pool, recent chunks and the current chunk
            chunks = max(1, layout.num_blocks) * layout.block_slots + cfg.keep_recent_chunks + 1
            tokens = cfg.sink_frames * layout.tokens_per_frame + chunks * layout.slot_tokens
        self.workspace.reserve(B * tokens * H * D, dtype, device)

    def allocate(self, codec: CodecConfig, tokens: int, slots: int) -> tuple[Packed, Packed]:
        """K and V storage of ``codec`` for ``tokens`` tokens in ``slots`` segment slots."""
        B, H, D, dtype, device = self.geometry
        return tuple(
            codec.allocate(
                batch=B,
                capacity_tokens=tokens,
                heads=H,
                head_dim=D,
                num_slots=slots,
                dtype=dtype,
                device=device,
                role=role,
            )
            for role in ("key", "value")
        )

    def memory_report(self) -> MemoryReport:
        sink = packed = ring = 0
        for layer in self.layers:
            sink += sum(s.nbytes for s in layer.sink or ())
            packed += sum(s.nbytes for kv in layer.blocks for s in kv)
            ring += sum(s.nbytes for s in layer.ring or ())
        current = ring * self.config.current_slots // self.layout.ring_slots if ring else 0
        tokens = sum(c.tokens for c in self.layout.chunks)
        per_token = 0
        if self.geometry is not None:
            B, H, D, _, _ = self.geometry
            per_token = 2 * B * H * D * 2 * len(self.layers)  # K and V, 2 bytes each, every layer
        rotary = 0 if self.planned is None else self.planned[1].rotary_nbytes
        return MemoryReport(
            sink=sink,
            packed=packed,
            recent=ring - current,
            current=current,
            workspace=self.workspace.nbytes + rotary,
            bf16_equivalent=tokens * per_token,
            cached_tokens=tokens,
        )
