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
    attention_mask: torch.Tensor | None = None,
    *,
    backend=None,
    parallel_config=None,
) -> torch.Tensor:
    """Attention output [B, n, H, D] of the chunk's ``query``/``key``/``value`` [B, n, H, D] (before RoPE).

    ``attention_mask`` [..., n, n] constrains the chunk's own tokens (SkyReels-V2's block-causal mask);
    every cached token before the chunk stays visible.
    """
    query = apply_wan_rotary(query, *rotary_emb)
    rotated_key = apply_wan_rotary(key, *rotary_emb)
    keys, values = layer.update(key, rotated_key, value)
    if attention_mask is not None:
        attention_mask = mask_for_window(attention_mask, keys.shape[1])
    return dispatch_attention_fn(
        query,
        keys,
        values,
        attn_mask=attention_mask,
        dropout_p=0.0,
        is_causal=False,
        backend=backend,
        parallel_config=parallel_config,
    )


def mask_for_window(mask: torch.Tensor, window_tokens: int) -> torch.Tensor:
    """Widen a chunk's mask [..., n, n] to [..., n, window_tokens]: the cached tokens come first, all visible."""
    n = mask.shape[-1]
    if mask.shape[-2] != n or n > window_tokens:
        raise ValueError(f"expected a square mask over the chunk's tokens, got shape {tuple(mask.shape)}")
    fill = mask.new_ones if mask.dtype == torch.bool else mask.new_zeros
    return torch.cat([fill(*mask.shape[:-1], window_tokens - n), mask], dim=-1)
