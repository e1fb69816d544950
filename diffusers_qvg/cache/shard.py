"""One rank's heads of a head-sharded cache under diffusers' Ulysses context parallelism.

Under ``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))`` rank ``r`` of the
Ulysses group holds tokens ``[r n/N, (r+1) n/N)`` of every chunk; the cached processors exchange them
(all-to-all) for all ``n`` tokens of heads ``[r H/N, (r+1) H/N)``, and the rank's cache stores exactly
those heads: 1/N of the bytes, and the same bytes per head as one process holding every head. Chunk plans,
evictions and packing decisions derive from replicated arguments (the unsplit transformer input, the chunk's
frames), so every rank makes the same ones without exchanging anything.

Ring attention (and ring x Ulysses) would make every rank gather every rank's K/V for all heads (no memory
saved, traffic growing with the window), and ``ulysses_anything``'s uneven shards do not map to whole
heads: both are refused here with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..codecs.base import HeadSlice


@dataclass(frozen=True, eq=False)
class HeadShard:
    """Heads ``[rank * heads, (rank + 1) * heads)`` of ``total_heads``, on rank ``rank`` of ``world`` in the
    Ulysses ``group`` of diffusers' ``config`` (a ``ContextParallelConfig``); ``device`` is the rank's."""

    config: object
    group: dist.ProcessGroup
    rank: int
    world: int
    total_heads: int
    device: torch.device

    @property
    def heads(self) -> int:
        return self.total_heads // self.world

    @property
    def head_slice(self) -> HeadSlice:
        return HeadSlice(self.rank * self.heads, self.heads, self.total_heads)

    def sum(self, values: list[int]) -> list[int]:
        """``values`` summed over the group's ranks (a collective: every rank calls it; one host read)."""
        total = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(total, group=self.group)
        return total.tolist()

    def describe(self) -> str:
        start = self.rank * self.heads
        return f"heads [{start}, {start + self.heads}) of {self.total_heads} (Ulysses rank {self.rank} of {self.world})"


def head_shard(parallel_config: object, total_heads: int) -> HeadShard | None:
    """The shard of a transformer whose ``_parallel_config`` is ``parallel_config`` (``None``, or diffusers'
    ``ParallelConfig``); ``None`` without context parallelism. Raises for configurations the cache cannot
    shard by heads, before anything changes."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None:
        return None
    if cp.ring_degree > 1:
        kind = "ring x Ulysses (unified)" if cp.ulysses_degree > 1 else "ring"
        raise NotImplementedError(
            f"{kind} context parallelism (ring_degree={cp.ring_degree}) is not supported with diffusers_qvg: "
            "diffusers' ring attention all-gathers every rank's K/V for all heads, so a cached window would "
            "cross the ranks in every layer of every forward and save no memory. Use "
            "ContextParallelConfig(ulysses_degree=N) (the cache then holds H/N heads per rank)"
        )
    if cp.ulysses_anything:
        raise NotImplementedError(
            "ContextParallelConfig(ulysses_anything=True) splits tokens and heads unevenly, which a "
            "head-sharded cache does not support; use ulysses_anything=False with a head count and a chunk "
            "token count divisible by ulysses_degree"
        )
    world = cp.ulysses_degree
    if total_heads % world:
        divisors = [n for n in range(2, total_heads + 1) if total_heads % n == 0]
        raise ValueError(
            f"the transformer has {total_heads} attention heads, not divisible by ulysses_degree={world}; each rank "
            f"caches whole heads, so use a ulysses_degree that divides {total_heads} (one of {divisors})"
        )
    if cp._ulysses_mesh is None:
        raise RuntimeError(
            "the ContextParallelConfig has no device mesh yet; enable it with "
            "transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))"
        )
    return HeadShard(
        config=cp,
        group=cp._ulysses_mesh.get_group(),
        rank=cp._ulysses_local_rank,
        world=world,
        total_heads=total_heads,
        device=torch.device(cp._device),
    )
