"""``QVGWanAttnProcessor``: diffusers' ``WanAttnProcessor`` with self-attention through the cache.

Outside an active ``cache.chunk(...)``, and for cross-attention always, it *is* the stock processor (it
calls it), so outputs are bit-identical. Inside a chunk, self-attention projects, normalises and rotates
exactly as stock does, writes the chunk's K/V into its layer of the cache, and attends to the window.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor, _get_qkv_projections

from ..attention import cached_self_attention
from ..cache import QVGCache


class QVGWanAttnProcessor(WanAttnProcessor):
    """Inherits the ``_attention_backend`` / ``_parallel_config`` class attributes, so
    ``transformer.set_attention_backend`` reaches it."""

    def __init__(self, cache: QVGCache, layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx

    def __call__(
        self,
        attn: WanAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or not self.cache.active:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        if attention_mask is not None or rotary_emb is None:
            raise ValueError(
                "cached self-attention needs the transformer's RoPE and takes no attention mask (the cache "
                "defines what each chunk sees); call the transformer, not the attention module, inside cache.chunk"
            )
        if getattr(self._parallel_config, "context_parallel_config", None) is not None:
            raise NotImplementedError(
                "context parallelism splits a chunk's tokens across ranks, which this cache does not shard yet; "
                "use data parallelism (one video per rank) with the cache"
            )
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))

        hidden_states = cached_self_attention(
            self.cache.layers[self.layer_idx],
            query,
            key,
            value,
            rotary_emb,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


def self_attention_names(transformer: torch.nn.Module) -> list[str]:
    """Module names of the transformer's Wan self-attention layers, in layer order."""
    return [n for n, m in transformer.named_modules() if isinstance(m, WanAttention) and not m.is_cross_attention]


def processors_for(transformer: torch.nn.Module, cache: QVGCache) -> dict[str, WanAttnProcessor]:
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
        processor = QVGWanAttnProcessor(cache, idx)
        processor._attention_backend = getattr(current, "_attention_backend", None)
        processor._parallel_config = getattr(current, "_parallel_config", None)
        processors[f"{name}.processor"] = processor
    return processors
