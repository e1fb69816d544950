"""A layer's two cache verbs as opaque torch ops, so a compiled forward calls them instead of tracing the cache.

Inside ``torch.compile`` the cache's Python bookkeeping (which storage holds which chunk, the moves of a
clean-context pass) must not be traced: it changes every chunk and would recompile the forward. Each verb is
therefore a custom op that the compiler sees as one opaque call with fixed-shape tensor arguments; its
implementation runs the cache's eager code, reading the live plan. Eager forwards call that code directly.

- ``read_window`` decodes the layer's visible history and the current chunk into the window views
  (it mutates them: the attention that follows depends on it).
- ``store`` rewrites the current chunk's ring slot ("on-advance"), and ``store_final`` carries out a
  clean-context pass's moves for a group of layers (``CacheConfig.encode_layers``: their K/V reach it
  through the graph, so the compiler keeps them alive until then, with no copy). Both mutate the cache's
  write status, which orders them after the reads of the same window and keeps them alive.

Both read the plan of the chunk at run time (segment tables and RoPE tables made per chunk, host rows for
the PyTorch decoders), which a replayed CUDA graph would not: they are tagged ``cudagraph_unsafe``, so CUDA
graphs (``mode="reduce-overhead"``) are split around them and stay correct. docs/generate.md says what a
capture of the whole forward would need.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .cache import QVGCache
    from .layer import LayerCache

_CACHES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_IDS = itertools.count()


def register(cache: object) -> int:
    """A process-unique id for ``cache``, the constant its compiled forwards pass to the ops."""
    key = next(_IDS)
    _CACHES[key] = cache
    return key


def _layer(cache: int, layer: int) -> "LayerCache":
    return _CACHES[cache].layers[layer]


@torch.library.custom_op(
    "diffusers_qvg::read_window", mutates_args=("keys", "values"), tags=(torch.Tag.cudagraph_unsafe,)
)
def _read_window_op(
    keys: torch.Tensor, values: torch.Tensor, rotated_key: torch.Tensor, value: torch.Tensor, cache: int, layer: int
) -> None:
    _layer(cache, layer).read(keys, values, rotated_key, value)


@_read_window_op.register_fake
def _(keys, values, rotated_key, value, cache, layer) -> None:
    return None


@torch.library.custom_op(
    "diffusers_qvg::store", mutates_args=("status",), tags=(torch.Tag.cudagraph_unsafe,)
)
def _store_op(
    status: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: torch.Tensor, cache: int, layer: int
) -> None:
    target = _layer(cache, layer)
    with target.owner.status.bound(status):
        target.store(key, value)


@_store_op.register_fake
def _(status, key, value, window, cache, layer) -> None:
    return None


@torch.library.custom_op(
    "diffusers_qvg::store_final", mutates_args=("status",), tags=(torch.Tag.cudagraph_unsafe,)
)
def _store_final_op(
    status: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], window: torch.Tensor, cache: int,
    layers: list[int],
) -> None:
    owner = _CACHES[cache]
    with owner.status.bound(status):
        owner.store_final(layers, keys, values)


@_store_final_op.register_fake
def _(status, keys, values, window, cache, layers) -> None:
    return None


def read_window(
    layer: "LayerCache", keys: torch.Tensor, values: torch.Tensor, rotated_key: torch.Tensor, value: torch.Tensor
) -> None:
    if torch.compiler.is_compiling():
        torch.ops.diffusers_qvg.read_window(keys, values, rotated_key, value, layer.owner.op_id, layer.index)
    else:
        layer.read(keys, values, rotated_key, value)


def store(layer: "LayerCache", key: torch.Tensor, value: torch.Tensor, window: torch.Tensor) -> None:
    """The "on-advance" rewrite of the current chunk; ``window``: the keys the layer just read, so that
    the store follows the read."""
    if torch.compiler.is_compiling():
        status = layer.owner.status.tensor
        torch.ops.diffusers_qvg.store(status, key, value, window, layer.owner.op_id, layer.index)
    else:
        layer.store(key, value)


def store_final(
    cache: "QVGCache", layers: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], window: torch.Tensor
) -> None:
    """A clean-context pass's writes of a group of layers (their K as stored, and V), in one call; ``window``:
    the keys the group's last layer just read."""
    if torch.compiler.is_compiling():
        torch.ops.diffusers_qvg.store_final(cache.status.tensor, keys, values, window, cache.op_id, layers)
    else:
        cache.store_final(layers, keys, values)
