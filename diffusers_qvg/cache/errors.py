"""Errors of the cache's write contract."""

from __future__ import annotations


class ChunkRewriteSizeError(ValueError):
    """A rewrite of the current chunk changed its token count (the cache slot has a fixed size)."""

    def __init__(self, layer: int, chunk_start: int, old_tokens: int, new_tokens: int) -> None:
        self.layer, self.chunk_start, self.old_tokens, self.new_tokens = layer, chunk_start, old_tokens, new_tokens
        super().__init__(
            f"layer {layer}: the current chunk at frame {chunk_start} holds {old_tokens} tokens but this write "
            f"has {new_tokens}. Either keep every rewrite of a chunk the same length (same frames and "
            f"resolution), or advance to a new chunk with cache.chunk(start_frame=<end of the current chunk>)"
        )
