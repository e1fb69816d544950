"""Attention of a chunk's queries over the cache (sink, history, recent, current)."""

from .cached import cached_self_attention
from .ulysses import ulysses_cached_self_attention

__all__ = ["cached_self_attention", "ulysses_cached_self_attention"]
