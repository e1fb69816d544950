"""Attention processors that route a chunk's self-attention through the cache."""

from .select import processors_for
from .skyreels_v2 import QVGSkyReelsV2AttnProcessor
from .wan import QVGWanAttnProcessor

__all__ = ["QVGSkyReelsV2AttnProcessor", "QVGWanAttnProcessor", "processors_for"]
