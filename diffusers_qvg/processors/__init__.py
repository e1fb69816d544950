"""Attention processors that route a chunk's self-attention through the cache."""

from .wan import QVGWanAttnProcessor, processors_for

__all__ = ["QVGWanAttnProcessor", "processors_for"]
