"""``QVGSkyReelsV2AttnProcessor``: SkyReels-V2's processor (Wan's layout) with self-attention through the cache."""

from __future__ import annotations

from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2AttnProcessor

from .cached import CachedSelfAttentionProcessor


class QVGSkyReelsV2AttnProcessor(CachedSelfAttentionProcessor, SkyReelsV2AttnProcessor):
    """For ``SkyReelsV2Attention``; its block-causal mask inside a chunk is widened over the cached window."""
