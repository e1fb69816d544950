"""Which cached processor each attention module gets: the dict ``set_attn_processor`` takes."""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2Attention, SkyReelsV2AttnProcessor
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

from ..cache import QVGCache
from .skyreels_v2 import QVGSkyReelsV2AttnProcessor
from .wan import QVGWanAttnProcessor

CACHED_PROCESSORS = {WanAttention: QVGWanAttnProcessor, SkyReelsV2Attention: QVGSkyReelsV2AttnProcessor}
STOCK_PROCESSORS = {QVGWanAttnProcessor: WanAttnProcessor, QVGSkyReelsV2AttnProcessor: SkyReelsV2AttnProcessor}


def stock_processor(processor: object) -> object:
    """``processor`` itself, or a new stock processor in place of a cached one."""
    stock = STOCK_PROCESSORS.get(type(processor))
    return processor if stock is None else stock()


def self_attention_names(transformer: torch.nn.Module) -> list[str]:
    """Module names of the transformer's Wan-layout self-attention layers, in layer order."""
    return [
        name
        for name, module in transformer.named_modules()
        if type(module) in CACHED_PROCESSORS and not module.is_cross_attention
    ]


def processors_for(transformer: torch.nn.Module, cache: QVGCache) -> dict[str, object]:
    """A ``set_attn_processor`` dict: cached processors for self-attention, the current ones elsewhere.

    The cached processors keep each module's attention backend and parallel config.
    """
    names = self_attention_names(transformer)
    if len(names) != len(cache.layers):
        raise ValueError(
            f"the transformer has {len(names)} Wan self-attention layers but the cache has {len(cache.layers)}; "
            "create the cache for this transformer with diffusers_qvg.enable_qvg"
        )
    processors = dict(transformer.attn_processors)
    for idx, name in enumerate(names):
        current = processors[f"{name}.processor"]
        processor = CACHED_PROCESSORS[type(transformer.get_submodule(name))](cache, idx)
        processor._attention_backend = getattr(current, "_attention_backend", None)
        processor._parallel_config = getattr(current, "_parallel_config", None)
        processors[f"{name}.processor"] = processor
    return processors
