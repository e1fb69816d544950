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

Passing the transformer input, ``cache.chunk(start_frame=f, hidden_states=x)``, plans the chunk when the block
starts instead of at the first forward: the forward then holds tensor work only, which ``torch.compile``
(``fullgraph=True``) needs. Writes are checked on the device (:class:`~diffusers_qvg.codecs.status.WriteStatus`)
and the check is read once, when the block ends: a failed write raises there, and if it was the block's first
write, the cache is exactly as it was.

A prompt switch stores the visible chunks after the sink again under the new text (LongLive's KV re-cache),
one clean-context pass each, through this same write path::

    with cache.recache() as chunks:                   # [(start_frame, frames), ...], oldest first
        for start, frames in chunks:
            with cache.chunk(start_frame=start, final=True):
                transformer(clean_latents[start], 0, new_prompt_embeds)

A stream longer than the transformer's RoPE table re-bases its window's positions (keys are stored before
RoPE and rotated as they are read): see :func:`~diffusers_qvg.cache.plan.window_positions`.

Under diffusers' Ulysses context parallelism (``transformer.enable_parallelism(config=ContextParallelConfig(
ulysses_degree=N))``, before or after ``enable_qvg``) each rank's cache holds its H/N heads (:mod:`.shard`);
every rank plans the same chunks, and a write refused on one rank is refused on all (the write status is
agreed over the group on the device).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..codecs import CodecConfig, Packed
from ..codecs.base import HeadSlice
from ..codecs.status import WriteStatus
from ..rope_frames import patch_grid, wan_rope_for_frames
from ..rotary import compute_dtype_for
from .config import CacheConfig
from . import ops
from .errors import ChunkRewriteSizeError
from .layer import LayerCache, apply_move
from .layout import ChunkLayout, Move
from .memory import MemoryReport
from .plan import ReadPlan, build_read_plan, window_positions
from .shard import HeadShard, head_shard
from .workspace import Workspace


@dataclass
class Commit:
    """A clean-context pass in flight: every layer carries out ``moves`` after attending; then the cache
    adopts ``layout`` (``previous`` is the layout it replaces, restored if the pass's first write fails)."""

    layout: ChunkLayout
    moves: list[Move]
    previous: ChunkLayout
    storage: list[tuple] = field(default_factory=list)  # each layer's storage before the pass
    layers_done: set[int] = field(default_factory=set)
    pending: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # attended, not stored

    def take_pending(self) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
        """The held layers' indices, K and V, no longer held."""
        indices, keys, values = [p[0] for p in self.pending], [p[1] for p in self.pending], [p[2] for p in self.pending]
        self.pending.clear()
        return indices, keys, values


class QVGCache:
    """KV cache of a transformer's self-attention layers for chunk-by-chunk generation (inference only)."""

    def __init__(
        self,
        config: CacheConfig | None = None,
        num_layers: int | None = None,
        guard: Callable[[], None] | None = None,
        *,
        rope: torch.nn.Module | None = None,
        heads: int | None = None,
        head_dim: int | None = None,
    ) -> None:
        """``config`` defaults to ``CacheConfig()``. ``num_layers``: the transformer's self-attention layers;
        ``None`` finds them as their processors first call the cache, in order, during the first chunk
        (a shared ``QVGWanAttnProcessor(cache)`` needs no count); after that block the count is fixed.

        ``guard`` runs at every :meth:`chunk` (the installer refuses block-skipping caches there).
        ``rope`` (the transformer's ``WanRotaryPosEmbed``), ``heads`` and ``head_dim`` let
        ``chunk(hidden_states=...)`` plan a chunk and size its window before the forward;
        :func:`~diffusers_qvg.enable_qvg` and :meth:`attach` pass them, and ``parallel``, which returns the
        transformer's diffusers ``_parallel_config`` (read at every :meth:`chunk`: Ulysses shards the heads).
        """
        config = CacheConfig() if config is None else config
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a diffusers_qvg.CacheConfig, got {type(config).__name__}")
        if num_layers is not None and (not isinstance(num_layers, int) or num_layers < 1):
            raise ValueError(f"num_layers={num_layers!r} is invalid: use a positive integer or None (found in use)")
        self.config = config
        self.layers = [LayerCache(self, i) for i in range(num_layers or 0)]
        self.layers_fixed = num_layers is not None
        self.module_layers: dict[int, int] = {}  # id(attention module) -> layer, for processors without an index
        self.workspace = Workspace()
        self.guard = guard
        self.rope, self.heads, self.head_dim = rope, heads, head_dim
        self.parallel: Callable[[], object] | None = None
        self.shard: HeadShard | None = None  # this rank's heads under Ulysses context parallelism
        self.op_id = ops.register(self)
        self.status: WriteStatus | None = None
        self.active = False  # a bool, not derived from active_start: compiled forwards guard on it
        self.active_start: int | None = None
        self.active_final = False
        self.recaching: list[tuple[int, int]] | None = None  # the chunks of an open cache.recache() block
        self.reset()

    def reset(self, config: CacheConfig | None = None) -> None:
        """Forget every chunk and free all storage (the next video starts at any frame); ``config``
        replaces the cache's policy for the next video (a compiled transformer keeps its cache, and so its
        graphs, from one video to the next)."""
        if self.active:
            raise RuntimeError("cache.reset() inside an active cache.chunk(...) block; reset between chunks")
        if self.recaching is not None:
            raise RuntimeError("cache.reset() inside a cache.recache() block; leave the block first")
        if config is not None:
            if not isinstance(config, CacheConfig):
                raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
            self.config = config
        self.layout = ChunkLayout(self.config)
        self.geometry: tuple[int, int, int, torch.dtype, torch.device] | None = None
        self.plan: ReadPlan | None = None
        self.planned: tuple[ChunkLayout, ReadPlan] | None = None
        self.window: tuple[torch.Tensor, torch.Tensor] | None = None  # this forward's views of the workspace
        self.commit: Commit | None = None
        self.interrupted: str | None = None
        self.block_writes = 0  # checked writes in the current chunk block (the status is read if any)
        for layer in self.layers:
            layer.ring, layer.sink, layer.blocks, layer.window, layer.views = None, None, [], None, None
        self.workspace.release()

    @contextmanager
    def chunk(
        self, start_frame: int, final: bool = False, *, hidden_states: torch.Tensor | None = None
    ) -> Iterator["QVGCache"]:
        """Forwards inside write the chunk starting at latent frame ``start_frame`` and attend to the cache.

        ``final=True`` marks the chunk's clean-context pass: under ``commit="final-pass"`` its one forward
        stores the chunk for good; under ``"on-advance"`` it changes nothing (the next chunk makes it final).
        ``hidden_states``: the transformer input [B, C, F, H, W] (or a tensor of its shape, dtype and device);
        given, the chunk is planned now rather than by the first forward's RoPE hook, so that the forward
        does tensor work only (``torch.compile(..., fullgraph=True)`` needs it).
        """
        if self.active:
            raise RuntimeError(f"a chunk at frame {self.active_start} is already active; chunk blocks do not nest")
        if self.interrupted is not None:
            raise RuntimeError(self.interrupted)
        if self.recaching is not None:
            self.check_recache_start(start_frame, final)
        self.layout.check_start(start_frame, final)
        if hidden_states is not None and self.rope is None:
            raise ValueError(
                "cache.chunk(hidden_states=...) plans the chunk with the transformer's RoPE module, which this "
                "cache was not given; call `diffusers_qvg.attach_cache(transformer, cache)` once (or create the "
                "cache with diffusers_qvg.enable_qvg(transformer, ...))"
            )
        if self.guard is not None:
            self.guard()
        self.follow_parallelism()
        self.active, self.active_start, self.active_final, self.plan, self.window = True, start_frame, final, None, None
        self.block_writes, self.block_moved = 0, False
        start_layout, completed = self.layout, False
        try:
            if hidden_states is not None:
                self.begin_forward(self.rope, hidden_states, *patch_grid(self.rope, hidden_states))
            yield self
            self.store_pending()
            completed = True
        finally:
            self.end_chunk(start_frame, completed, start_layout)

    def follow_parallelism(self) -> None:
        """Take the transformer's current context parallelism (``enable_parallelism`` may come after
        ``enable_qvg``): refused configurations raise here, on every rank, before the chunk starts."""
        shard = None if self.parallel is None else head_shard(self.parallel(), self.heads)
        old = self.shard
        if (shard is None and old is None) or (shard is not None and old is not None and shard.config is old.config):
            return
        if self.geometry is not None:
            held = "all heads" if old is None else old.describe()
            now = "no context parallelism" if shard is None else shard.describe()
            raise ValueError(
                f"the cache holds {held} of its video but the transformer now runs with {now}; call cache.reset() "
                "before changing the transformer's parallelism"
            )
        self.shard = shard

    @property
    def head_slice(self) -> HeadSlice | None:
        """Which of the model's heads this cache holds (``None``: all of them), for the codecs."""
        return None if self.shard is None else self.shard.head_slice

    def end_chunk(self, start_frame: int, completed: bool, start_layout: ChunkLayout) -> None:
        """Close a chunk block: read the device-side write checks once, and settle a clean-context pass.

        A block that raised before it stored anything, or whose first write failed, leaves the cache as it
        was (its layout restored; nothing was stored, every store being predicated on the status); a later
        failure means some layers stored the chunk and others did not, and the cache refuses to go on until
        it is reset. Layers of a group whose last layer never attended stored nothing (their K/V are dropped).
        """
        commit, failure, stored = self.commit, None, 0
        if commit is not None and commit.pending:  # the pass stopped before its group's last layer
            completed = False  # those layers stored nothing
        self.active, self.active_start, self.active_final = False, None, False
        self.plan, self.window, self.commit = None, None, None
        if not completed and not self.block_writes and not self.block_moved:
            self.layout = start_layout  # planned, never stored: the chunk is not there
        if self.status is not None and self.block_writes:
            failure, stored = self.status.read() if completed else (None, 0)
            self.status.clear()
        if failure is not None and stored == 0:
            if commit is not None:  # storage allocated for the pass was never written: drop it too
                self.layout = commit.previous
                storage = commit.storage + [(None, None, 0)] * (len(self.layers) - len(commit.storage))
                for layer, (ring, sink, blocks) in zip(self.layers, storage):  # layers found by this pass: empty
                    layer.ring, layer.sink, layer.blocks = ring, sink, layer.blocks[:blocks]
            raise ValueError(f"{failure}; nothing was cached")
        if completed and self.layers:
            self.layers_fixed = True
        if failure is None and commit is not None and len(commit.layers_done) == len(self.layers):
            self.layout = commit.layout  # every layer stored the chunk: it is final
        partial = commit is not None and commit.layers_done and len(commit.layers_done) < len(self.layers)
        if failure is not None or partial:
            done = f"{len(commit.layers_done)} of {len(self.layers)} layers" if partial else f"{stored} writes"
            self.interrupted = (
                f"the clean-context pass of the chunk at frame {start_frame} stopped after {done} stored it, so "
                "the layers disagree; call cache.reset() and generate the video again"
            )
            if failure is not None:
                raise ValueError(f"{failure}; {self.interrupted}")

    def begin_forward(
        self, rope: torch.nn.Module, hidden_states: torch.Tensor, frames: int, height: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Plan the chunk of the active block (rewrite or advance) and its reads, once per block: from
        :meth:`chunk` given ``hidden_states``, else from the first forward's RoPE hook.

        Returns the chunk's RoPE ``(cos, sin)`` at its global frame positions.
        """
        if self.plan is not None:  # a further forward of the block: the same chunk, the same plan
            commit = self.commit
            if not torch.compiler.is_compiling() and commit is not None and (commit.layers_done or commit.pending):
                if len(commit.layers_done) == len(self.layers):
                    commit.layout.check_start(self.active_start)  # raises: the chunk had its final pass
                raise RuntimeError(
                    "the previous forward stopped part-way through its clean-context pass; leave the "
                    "cache.chunk(...) block, call cache.reset() and generate the video again"
                )
            self.check_forward(hidden_states, frames, height, width)
            return self.plan.current_rotary
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "a compiled transformer forward cannot plan its chunk (Python bookkeeping); plan it before the "
                "forward: `with cache.chunk(start_frame=f, hidden_states=x): transformer(hidden_states=x, ...)`"
            )
        expected = self.recache_next()
        if expected is not None and frames != expected[1]:
            raise ValueError(
                f"the chunk at frame {expected[0]} has {expected[1]} frames but this re-cache pass has {frames}; "
                "store every chunk again from its own clean latents"
            )
        if self.shard is not None and (frames * height * width) % self.shard.world:
            raise ValueError(
                f"the chunk has {frames * height * width} tokens ({frames} frames of {height}x{width} patches), not "
                f"divisible by ulysses_degree={self.shard.world}: diffusers splits every chunk's tokens evenly "
                "across the ranks; pick a resolution or chunk length whose token count it divides"
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
        if self.config.commit == "on-advance" and not bool(torch.isfinite(hidden_states).all()):
            # Every "on-advance" forward stores its chunk without a device-side check: one host read here.
            raise ValueError("the transformer input contains NaN or Inf; nothing was cached")
        if self.planned is None or self.planned[0] is not layout:
            # Held in the compute dtype (float32; float64 for float64 models): half the bytes every layer's
            # read rotates with, and no float64 arithmetic on the GPU.
            dtype = compute_dtype_for(hidden_states.dtype)
            positions = window_positions(layout, rope.max_seq_len)
            rotary = tuple(t.to(dtype) for t in wan_rope_for_frames(rope, positions, height, width))
            self.planned = (layout, build_read_plan(layout, rotary, hidden_states.device))
        final = self.active_final and self.config.commit == "final-pass"
        commit = None
        if final:
            storage = [(layer.ring, layer.sink, len(layer.blocks)) for layer in self.layers]
            commit = Commit(*layout.finalize(), previous=layout, storage=storage)
        if moves and not self.config.in_place:  # in place, a finished chunk already is where it belongs
            self.block_moved = True
            self.apply_moves(moves, layout)
        self.layout = layout
        self.plan = self.planned[1]
        self.commit = commit
        self.forward_geometry = (hidden_states.shape[0], frames, height, width)
        if self.geometry is None and self.heads is not None:
            heads = self.heads if self.shard is None else self.shard.heads
            self.set_geometry(hidden_states.shape[0], heads, self.head_dim, hidden_states.dtype, hidden_states.device)
        if self.geometry is not None:
            self.reserve_workspace()
            if not self.config.in_place:
                self.window_views()
        return self.plan.current_rotary

    @property
    def group_size(self) -> int:
        """Layers per encoder call: ``CacheConfig.encode_layers`` (1 in place, where nothing is encoded)."""
        return 1 if self.config.in_place else self.config.encode_layers

    def layer_groups(self, layers: list[LayerCache]) -> list[list[LayerCache]]:
        """``layers`` in groups of :attr:`group_size`, each group's writes one encoder call."""
        size = self.group_size
        return [layers[i : i + size] for i in range(0, len(layers), size)]

    def apply_moves(self, moves: list[Move], layout: ChunkLayout) -> None:
        """An advance's moves (into the sink, the packed pool), every layer, checked on the device and read
        once: a failure before anything was stored leaves the cache as it was."""
        for move in moves:
            for group in self.layer_groups(self.layers):
                apply_move(group, move, layout, [None] * len(group))
        failure, stored = self.status.read()
        self.status.clear()
        if failure is not None:
            if stored:
                self.interrupted = (
                    f"the advance to the chunk at frame {self.active_start} stopped after {stored} writes; call "
                    "cache.reset() and generate the video again"
                )
            raise ValueError(f"{failure}; " + ("nothing was cached" if not stored else self.interrupted))

    def check_forward(self, hidden_states: torch.Tensor, frames: int, height: int, width: int) -> None:
        """A further forward of the block must have the geometry the block was planned with."""
        planned = self.forward_geometry
        if (hidden_states.shape[0], frames, height, width) != planned:
            if (frames, height, width) != planned[1:]:
                raise ChunkRewriteSizeError(0, self.active_start, self.plan.current_tokens, frames * height * width)
            raise ValueError(
                f"this forward has batch {hidden_states.shape[0]} but the chunk was planned for batch {planned[0]}; "
                "keep batch fixed for a video (batch both CFG branches)"
            )

    # Re-cache: the visible chunks after the sink stored again (a prompt switch, LongLive's KV re-cache).
    def recache_chunks(self) -> list[tuple[int, int]]:
        """``(start_frame, frames)`` of the chunks :meth:`recache` stores again, oldest first: every visible
        chunk after the sink (a stream keeps their clean latents for that, and frees them as they leave)."""
        return [(c.start_frame, c.frames) for c in self.layout.chunks if c.place in ("recent", "packed")]

    @contextmanager
    def recache(self) -> Iterator[list[tuple[int, int]]]:
        """Store the visible chunks after the sink again, from the clean-context passes the block runs.

        Yields :meth:`recache_chunks`; run each one's clean-context pass inside, in that order::

            with cache.recache() as chunks:
                for start, frames in chunks:
                    with cache.chunk(start_frame=start, final=True, hidden_states=x[start]):
                        transformer(x[start], context_noise, new_prompt_embeds)

        Each pass attends to the sink and to the chunks stored again before it, as the chunk's own clean-context
        pass attended to the chunks then visible, and stores through the cache's write path: into the
        storage the chunks had (nothing is allocated), packed chunks packed again from the new K/V. The sink
        keeps its K/V. Between chunks, under ``commit="final-pass"``. A block that ends before the first
        chunk is stored again leaves the cache as it was; one that stops after it leaves the window part
        stored again, and the cache refuses further chunks until :meth:`reset`.
        """
        if self.active:
            raise RuntimeError("cache.recache() inside an active cache.chunk(...) block; re-cache between chunks")
        if self.interrupted is not None:
            raise RuntimeError(self.interrupted)
        if self.recaching is not None:
            raise RuntimeError("cache.recache() blocks do not nest")
        if self.config.commit != "final-pass":
            raise ValueError(
                "cache.recache() stores chunks by clean-context passes, which only commit='final-pass' has; "
                "enable the cache with commit='final-pass'"
            )
        current = self.layout.current
        if current is not None:
            raise RuntimeError(
                f"the chunk at frame {current.start_frame} is being denoised; re-cache between chunks, after its "
                f"clean-context pass (cache.chunk(start_frame={current.start_frame}, final=True))"
            )
        chunks, before = self.recache_chunks(), self.layout
        self.layout, self.recaching = before.rewound(), chunks
        completed = False
        try:
            yield list(chunks)
            completed = True
        finally:
            self.end_recache(before, completed)

    def recache_next(self) -> tuple[int, int] | None:
        """The chunk an open :meth:`recache` block stores next (``None``: no block, or all are stored)."""
        if self.recaching is None:
            return None
        todo = self.recaching[len(self.recache_chunks()) :]
        return todo[0] if todo else None

    def check_recache_start(self, start_frame: int, final: bool) -> None:
        expected = self.recache_next()
        if expected is None:
            raise ValueError("every chunk of this re-cache is stored again; leave the cache.recache() block")
        if start_frame != expected[0] or final is not True:
            raise ValueError(
                f"inside cache.recache(), run the clean-context pass of the chunk at frame {expected[0]} "
                f"(cache.chunk(start_frame={expected[0]}, final=True)), the next to store again; got "
                f"start_frame={start_frame!r}, final={final!r}"
            )

    def end_recache(self, before: ChunkLayout, completed: bool) -> None:
        chunks, self.recaching = self.recaching, None
        done = self.recache_chunks()
        if self.interrupted is None and done == chunks:
            return
        if self.interrupted is None and not done:
            self.layout = before  # nothing was stored again: the window is as it was
            if completed:
                raise RuntimeError(
                    f"the cache.recache() block ended before storing the chunk at frame {chunks[0][0]} again; run "
                    "the clean-context pass of every chunk it yields, in order (the cache is unchanged)"
                )
            return
        if self.interrupted is None:
            self.interrupted = (
                f"the re-cache stopped after storing {len(done)} of {len(chunks)} chunks again, so the window "
                "holds K/V of different passes; call cache.reset() and generate the video again"
            )
        if completed:
            raise RuntimeError(self.interrupted)

    def commit_layer(self, layer: LayerCache, key: torch.Tensor, value: torch.Tensor, window: torch.Tensor) -> None:
        """A clean-context pass's K (as stored) and V of ``layer``, which has attended: held until the last
        layer of its group (:attr:`group_size`), which stores the group's in one call. Traced by
        ``torch.compile``: the held tensors are graph values, alive until the group's op."""
        pending = self.commit.pending
        pending.append((layer.index, key, value))
        if len(pending) >= self.group_size or (self.layers_fixed and layer.index + 1 == len(self.layers)):
            ops.store_final(self, *self.commit.take_pending(), window)

    def store_pending(self) -> None:
        """Store the last group of a clean-context pass whose layers were still being found (their count
        open, no layer knew it was the last)."""
        commit = self.commit
        if commit is not None and commit.pending and not self.layers_fixed:
            self.store_final(*commit.take_pending())

    @torch.no_grad()
    def store_final(self, indices: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store a group of layers' clean-context K/V where the pass's moves say: every layer's K/V checked
        first (an error found on the host raises before the group stores anything), then each move for all
        of them in one call (on the device a write stores only while no write checked before it failed)."""
        layers = [self.layers[i] for i in indices]
        for layer, key, value in zip(layers, keys, values):
            layer.check_final(key, value)
        if not self.config.in_place:  # in place, the read stored the chunk (the next read moves it if need be)
            for move in self.commit.moves:
                apply_move(layers, move, self.commit.layout, list(zip(keys, values)))
        for index in indices:
            self.layer_committed(index)

    def layer_committed(self, index: int) -> None:
        """Layer ``index`` stored its part of the clean-context pass; once all have, the chunk is final (for
        layers still being found, at the block's end)."""
        self.commit.layers_done.add(index)
        if self.layers_fixed and len(self.commit.layers_done) == len(self.layers):
            self.layout = self.commit.layout

    def layer_for(self, module: torch.nn.Module) -> LayerCache:
        """The layer of a self-attention ``module`` whose processor has no index: found in call order
        during the first chunk, then fixed."""
        index = self.module_layers.get(id(module))
        if index is None:
            if self.layers_fixed and len(self.module_layers) >= len(self.layers):
                raise ValueError(
                    f"{type(module).__name__} {id(module):#x} calls this cache, which already holds the "
                    f"{len(self.layers)} self-attention layers it found; use one cache per transformer (and "
                    "one processor setup per cache)"
                )
            index = len(self.module_layers)
            self.module_layers[id(module)] = index
            if index == len(self.layers):
                self.layers.append(LayerCache(self, index))
        return self.layers[index]

    def require_plan(self) -> ReadPlan:
        if self.plan is None:
            if self.active:
                raise RuntimeError(
                    "the transformer's RoPE has no frame offset for this cache, so the chunk's positions are "
                    "unknown; after transformer.set_attn_processor(...) call "
                    "`diffusers_qvg.attach_cache(transformer, cache)` once (diffusers_qvg.enable_qvg does both)"
                )
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
            self.set_geometry(B, H, D, key.dtype, key.device)
            self.reserve_workspace()

    def set_geometry(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.geometry = (batch, heads, head_dim, dtype, device)
        group = None if self.shard is None else self.shard.group
        if self.status is None or self.status.device != torch.device(device) or self.status.group is not group:
            self.status = WriteStatus(device, group)

    def window_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's K and V windows [B, W, H, D]: views of the front of the shared workspace."""
        if self.window is None:
            B, H, D, _, _ = self.geometry
            self.window = self.workspace.views((B, self.plan.window_tokens, H, D))
        return self.window

    def window_capacity(self) -> int:
        """Tokens of the largest window the layout can show: the window, or sink, packed pool, recent chunks
        and the current chunk."""
        layout, cfg = self.layout, self.config
        if cfg.window_frames is not None:
            return cfg.window_frames * layout.tokens_per_frame
        chunks = max(1, layout.num_blocks) * layout.block_slots + cfg.keep_recent_chunks + 1
        return cfg.sink_frames * layout.tokens_per_frame + chunks * layout.slot_tokens

    def reserve_workspace(self) -> None:
        """The shared window workspace, or under ``in_place`` each known layer's own buffers and this
        chunk's views of them (a layer found later plans its own, in its eager first forward)."""
        B, H, D, dtype, device = self.geometry
        tokens = self.window_capacity()
        if self.config.in_place:
            for layer in self.layers:
                layer.plan_views()
        elif self.workspace.reserve(B * tokens * H * D, dtype, device):
            self.window = None  # new buffers: the views of the old ones are stale

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

    def memory_report(self, gathered: bool = False) -> MemoryReport:
        """The cache's bytes by part; under Ulysses, this rank's (its H/N heads), or with ``gathered=True``
        the sum over the group's ranks (a collective: call it on every rank)."""
        sink = packed = ring = window = 0
        for layer in self.layers:
            sink += sum(s.nbytes for s in layer.sink or ())
            packed += sum(s.nbytes for kv in layer.blocks for s in kv)
            ring += sum(s.nbytes for s in layer.ring or ())
            window += 0 if layer.window is None else sum(s.nbytes for s in layer.window.storage)
        current = ring * self.config.current_slots // self.layout.ring_slots if ring else 0
        tokens = sum(c.tokens for c in self.layout.chunks)
        per_token = 0
        if self.geometry is not None:
            B, H, D, _, _ = self.geometry
            per_token = 2 * B * H * D * 2 * len(self.layers)  # K and V, 2 bytes each, every layer
        rotary = 0 if self.planned is None else self.planned[1].rotary_nbytes
        parts = [sink, packed, ring - current, current, self.workspace.nbytes + rotary, tokens * per_token, window]
        ranks = 1
        if gathered and self.shard is not None:
            parts, ranks = self.shard.sum(parts), self.shard.world
        *parts, window = parts
        return MemoryReport(*parts, cached_tokens=tokens, ranks=ranks, window=window)
