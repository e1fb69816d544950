"""Exact resident bytes of a cache, by part, and what the same tokens would cost in BF16."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of every tensor the cache holds (K and V, all layers), by part.

    ``workspace`` is the per-step scratch shared by all layers: the dense K/V window buffers and the
    window's RoPE table. ``bf16_equivalent`` is what the cached tokens (sink, packed, recent, current) would take as BF16 K and
    V; ``compression`` divides it by the cache's own bytes (workspace excluded: it is a per-step buffer).
    Preallocated capacity counts as resident, so the ratio is honest before the pool fills. Under
    ``commit="final-pass"`` ``current`` is 0: a chunk being denoised lives only in the workspace (its
    tokens still count in ``cached_tokens``, as a BF16 cache stores them), so read the ratio between chunks.

    ``window`` is the in-place storage of BF16 caches with rotated keys (``CacheConfig.in_place``): sink,
    history and current chunk in one buffer per layer, sized for the whole window, as Self-Forcing keeps
    them; such a cache has no other part and no workspace.

    Under Ulysses context parallelism a rank's cache holds its H/N heads: ``cache.memory_report()`` counts
    that rank's bytes (``ranks == 1``); ``cache.memory_report(gathered=True)`` sums the bytes of the group's
    ``ranks`` caches (``cached_tokens`` are the same tokens on every rank and are not summed).
    """

    sink: int
    packed: int
    recent: int
    current: int
    workspace: int
    bf16_equivalent: int
    cached_tokens: int
    ranks: int = 1
    window: int = 0

    @property
    def cache(self) -> int:
        return self.sink + self.packed + self.recent + self.current + self.window

    @property
    def total(self) -> int:
        return self.cache + self.workspace

    @property
    def compression(self) -> float:
        return self.bf16_equivalent / self.cache if self.cache else 0.0
