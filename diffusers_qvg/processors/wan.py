"""``QVGWanAttnProcessor``: diffusers' ``WanAttnProcessor`` with self-attention through the cache."""

from __future__ import annotations

from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from .cached import CachedSelfAttentionProcessor


class QVGWanAttnProcessor(CachedSelfAttentionProcessor, WanAttnProcessor):
    """For ``WanAttention`` (Wan 2.1/2.2 and the causal Self-Forcing, CausVid, LongLive, Krea variants)."""
