"""Cached self-attention of a token shard under diffusers' Ulysses context parallelism.

Each rank holds ``n/N`` tokens of a chunk for all ``H`` heads. One all-to-all (diffusers'
``_all_to_all_dim_exchange`` over the Ulysses group, q, k and v packed into one tensor) gives it all ``n``
tokens of its ``H/N`` heads; :func:`~.cached.cached_self_attention` then rotates them at their global frames,
writes them into the rank's head shard of the cache and attends over its window as one process would for
those heads; a second all-to-all returns the output to the token shard. Only the chunk's activations cross
the ranks, never the cache: the traffic is independent of the window.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from diffusers.models.attention_dispatch import _all_to_all_dim_exchange

from ..cache import LayerCache
from .cached import cached_self_attention


def ulysses_cached_self_attention(
    layer: LayerCache,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup,
    backend=None,
) -> torch.Tensor:
    """Attention output [B, n/N, H, D] of this rank's token shard ``query``/``key``/``value`` [B, n/N, H, D]
    (before RoPE); ``rotary_emb`` and ``attention_mask`` cover the whole chunk (all ``n`` tokens)."""
    head_dim = query.shape[-1]
    qkv = _all_to_all_dim_exchange(torch.cat([query, key, value], dim=-1), scatter_idx=2, gather_idx=1, group=group)
    query, key, value = qkv.split(head_dim, dim=-1)  # [B, n, H/N, D] each
    out = cached_self_attention(layer, query, key, value, rotary_emb, attention_mask, backend=backend)
    return _all_to_all_dim_exchange(out.contiguous(), scatter_idx=1, gather_idx=2, group=group)
