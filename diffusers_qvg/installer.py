"""``enable_qvg`` / ``disable_qvg``: install the cache on a Wan-family transformer, and take it off again.

Installing swaps the self-attention processors (see :func:`processors_for`) and registers the RoPE
frame-offset hook on ``transformer.rope``; the hook also records the processors it replaced, so
``disable_qvg`` restores exactly what was there.

Both work before or after diffusers' ``transformer.enable_parallelism(config=ContextParallelConfig(
ulysses_degree=N))``: the cached processors keep (or receive) the transformer's parallel config, and so do
the processors ``disable_qvg`` puts back.
"""

from __future__ import annotations

import torch
from diffusers.hooks import HookRegistry

from .cache import CacheConfig, QVGCache
from .cache.shard import head_shard
from .codecs import CodecConfig
from .processors import processors_for
from .processors.select import self_attention_names, stock_processor
from .rope_offset import ROPE_OFFSET_HOOK, add_rope_offset_hook, remove_rope_offset_hook

# Hooks of diffusers' caches that skip blocks or reuse attention outputs: they would skip cache writes.
SKIPPING_HOOK_PREFIXES = (
    "fbc_",
    "mag_cache_",
    "pyramid_attention_broadcast",
    "faster_cache_",
    "taylorseer_cache",
    "sea_cache_",
    "layer_skip_hook",
)


def refuse_block_skipping(transformer: torch.nn.Module) -> None:
    """Raise if a diffusers cache that skips blocks (FirstBlockCache, MagCache, PAB, ...) is active."""
    names = {
        name
        for module in transformer.modules()
        if isinstance(getattr(module, "_diffusers_hook", None), HookRegistry)
        for name in module._diffusers_hook.hooks
    }
    skipping = sorted(n for n in names if n.startswith(SKIPPING_HOOK_PREFIXES))
    if getattr(transformer, "is_cache_enabled", False) or skipping:
        raise ValueError(
            "a diffusers block-skipping cache (FirstBlockCache, MagCache, PyramidAttentionBroadcast, ...) is "
            f"active on this transformer{f' (hooks {skipping})' if skipping else ''}; it would skip KV-cache "
            "writes. Call transformer.disable_cache() (or remove those hooks) before using diffusers_qvg"
        )


def enable_qvg(
    transformer: torch.nn.Module,
    storage: CodecConfig | str = "qvg-int2",
    window_frames: int | None = None,
    sink_frames: int = 0,
    **options,
) -> QVGCache:
    """Route the transformer's self-attention through a new KV cache and return the cache.

    ``storage`` names the packed history's codec (``"qvg-int2"``, ``"bf16"``, ...) or is a codec config;
    ``options`` are the other :class:`CacheConfig` fields (``keep_recent_chunks``, ``sink_storage``,
    ``keys_before_rope``, ``warm_start``, ``chunk_frames``, ``commit``, ``expected_frames``). With
    ``commit="final-pass"`` run each chunk's clean-context pass inside ``cache.chunk(start_frame=f, final=True)``.
    """
    names = supported_layers(transformer)
    config = CacheConfig(storage=storage, window_frames=window_frames, sink_frames=sink_frames, **options)
    cache = QVGCache(config, len(names))
    originals = dict(transformer.attn_processors)
    transformer.set_attn_processor(processors_for(transformer, cache))
    attach_cache(transformer, cache, originals)
    return cache


def supported_layers(transformer: torch.nn.Module) -> list[str]:
    """The transformer's self-attention module names, once its support and state are checked."""
    registry = getattr(getattr(transformer, "rope", None), "_diffusers_hook", None)
    if registry is not None and registry.get_hook(ROPE_OFFSET_HOOK) is not None:
        raise ValueError("diffusers_qvg is already enabled on this transformer; call disable_qvg(transformer) first")
    names = self_attention_names(transformer)
    if not names or not hasattr(transformer, "rope"):
        raise ValueError(
            f"{type(transformer).__name__} has no Wan self-attention layers or no `rope` module; diffusers_qvg "
            "supports Wan-layout transformers (WanTransformer3DModel, SkyReelsV2Transformer3DModel)"
        )
    refuse_block_skipping(transformer)
    attn = transformer.get_submodule(names[0])
    head_shard(getattr(transformer, "_parallel_config", None), attn.heads)  # refuses ring, unified and uneven Ulysses now
    return names


def attach_cache(transformer: torch.nn.Module, cache: QVGCache, original_processors: dict | None = None) -> None:
    """Register the RoPE frame-offset hook for ``cache`` and give the cache what plans a chunk before its
    forward (the RoPE module, heads, head_dim) and its block-skipping guard.

    ``original_processors`` are what :func:`disable_qvg` restores; by default the current processors, with
    the stock class in place of each cached one (they were set by hand with ``set_attn_processor``).
    """
    names = supported_layers(transformer)
    if cache.layers_fixed and len(cache.layers) != len(names):
        raise ValueError(
            f"the cache has {len(cache.layers)} layers but {type(transformer).__name__} has {len(names)} "
            "self-attention layers; create the cache for this transformer"
        )
    if original_processors is None:
        original_processors = {name: stock_processor(p) for name, p in transformer.attn_processors.items()}
    attn = transformer.get_submodule(names[0])
    cache.rope, cache.heads, cache.head_dim = transformer.rope, attn.heads, attn.inner_dim // attn.heads
    cache.guard = lambda: refuse_block_skipping(transformer)
    cache.parallel = lambda: getattr(transformer, "_parallel_config", None)
    keep_parallel_config(transformer, transformer.attn_processors)  # processors set by hand have none yet
    add_rope_offset_hook(transformer.rope, cache, original_processors)


def disable_qvg(transformer: torch.nn.Module) -> None:
    """Restore the processors ``enable_qvg`` replaced and remove its RoPE hook."""
    registry = getattr(getattr(transformer, "rope", None), "_diffusers_hook", None)
    hook = None if registry is None else registry.get_hook(ROPE_OFFSET_HOOK)
    if hook is None:
        raise ValueError("diffusers_qvg is not enabled on this transformer; nothing to disable")
    if hook.cache.active:
        raise RuntimeError("disable_qvg inside an active cache.chunk(...) block; leave the block first")
    current = transformer.attn_processors
    restored = dict(hook.original_processors)
    for name, processor in restored.items():  # what changed since: set_attention_backend, enable_parallelism
        for attr in ("_attention_backend", "_parallel_config"):
            if hasattr(processor, attr) and hasattr(current[name], attr):
                setattr(processor, attr, getattr(current[name], attr))
    transformer.set_attn_processor(restored)
    remove_rope_offset_hook(transformer.rope)


def keep_parallel_config(transformer: torch.nn.Module, processors: dict) -> None:
    """Give ``processors`` that take one and have none the transformer's diffusers parallel config, as
    ``enable_parallelism`` gives every processor it finds."""
    config = getattr(transformer, "_parallel_config", None)
    if config is None or config.context_parallel_config is None:
        return
    for processor in processors.values():
        if hasattr(processor, "_parallel_config") and processor._parallel_config is None:
            processor._parallel_config = config
