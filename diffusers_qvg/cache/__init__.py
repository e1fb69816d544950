"""The two-level KV cache: a container of per-layer caches, storage policy through the codec interface."""

from .cache import QVGCache
from .config import CacheConfig
from .errors import ChunkRewriteSizeError
from .layer import LayerCache
from .memory import MemoryReport

__all__ = ["CacheConfig", "ChunkRewriteSizeError", "LayerCache", "MemoryReport", "QVGCache"]
