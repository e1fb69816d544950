"""Self-attention over one layer's cache: write the chunk, read the window once, attend once.

The layer decodes every visible segment exactly once, in one ``dequantize_into`` call per storage, into the
workspace shared by all layers, with the current chunk copied in behind them; one attention call through
diffusers' ``dispatch_attention_fn`` then covers the whole window, so attention backends keep working.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from ..cache import LayerCache
from ..rotary import apply_wan_rotary


def cached_self_attention(
    layer: LayerCache,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
    *,
    backend=None,
    parallel_config=None,
) -> torch.Tensor:
    """Attention output [B, n, H, D] of the chunk's ``query``/``key``/``value`` [B, n, H, D] (before RoPE)."""
    query = apply_wan_rotary(query, *rotary_emb)
    rotated_key = apply_wan_rotary(key, *rotary_emb)
    keys, values = layer.update(key, rotated_key, value)
    return dispatch_attention_fn(
        query,
        keys,
        values,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        backend=backend,
        parallel_config=parallel_config,
    )
