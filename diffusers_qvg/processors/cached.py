"""Self-attention through the cache for processors with Wan's layout (Wan, SkyReels-V2).

Mixed in before a stock processor class: outside an active ``cache.chunk(...)``, and for cross-attention
always, it calls the stock processor, so outputs are bit-identical. Inside a chunk, self-attention
projects and normalises exactly as stock does, then :func:`cached_self_attention` writes the chunk's K/V
into its layer of the cache and attends to the window. Under diffusers' Ulysses context parallelism the
projections and the QK norm (which spans all heads) run on this rank's token shard, and
:func:`ulysses_cached_self_attention` exchanges it for all tokens of the rank's heads around the same steps.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import _get_qkv_projections

from ..attention import cached_self_attention, ulysses_cached_self_attention
from ..cache import QVGCache


class CachedSelfAttentionProcessor:
    """Keeps the stock class's ``_attention_backend`` / ``_parallel_config`` class attributes, so
    ``transformer.set_attention_backend`` reaches it."""

    def __init__(self, cache: QVGCache, layer_idx: int | None = None) -> None:
        """``layer_idx=None``: one processor may serve every layer (``transformer.set_attn_processor(
        QVGWanAttnProcessor(cache))``); the cache finds each module's layer in call order."""
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or not self.cache.active:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        if rotary_emb is None:
            raise ValueError(
                "cached self-attention needs the transformer's RoPE; call the transformer, not the attention "
                "module, inside cache.chunk(...)"
            )
        plan = self.cache.require_plan()  # before the layer is looked up: a missing RoPE offset changes nothing
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))

        layer = self.cache.layers[self.layer_idx] if self.layer_idx is not None else self.cache.layer_for(attn)
        shard = self.cache.shard
        if shard is not None:  # this rank's tokens: the chunk's RoPE (all tokens) comes from the plan
            hidden_states = ulysses_cached_self_attention(
                layer, query, key, value, plan.current_rotary, attention_mask,
                group=shard.group, backend=self._attention_backend,
            )
        else:
            hidden_states = cached_self_attention(
                layer,
                query,
                key,
                value,
                rotary_emb,
                attention_mask,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)
