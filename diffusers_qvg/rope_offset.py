"""The RoPE frame-offset hook: a diffusers ``ModelHook`` on ``transformer.rope`` (no monkeypatching).

While a cache chunk is active it hands the cache the chunk's geometry instead of the stock table from frame 0;
the cache gathers the tables at the chunk's frames (:mod:`diffusers_qvg.rope_frames`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from diffusers.hooks import HookRegistry, ModelHook

from .rope_frames import patch_grid

if TYPE_CHECKING:
    from .cache import QVGCache

ROPE_OFFSET_HOOK = "qvg_rope_offset"


class RopeOffsetHook(ModelHook):
    """While a cache chunk is active, number the chunk's frames from its start frame and tell the cache.

    This is the one place a transformer forward announces its chunk geometry (frames, patch grid), so the
    cache decides rewrite or advance once per forward, before any layer runs.
    """

    def __init__(self, cache: "QVGCache", original_processors: dict) -> None:
        """``original_processors`` are the processors the installer replaced (``disable_qvg`` restores them)."""
        super().__init__()
        self.cache = cache
        self.original_processors = original_processors

    def new_forward(self, module: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.cache.active:
            return self.fn_ref.original_forward(hidden_states)
        return self.cache.begin_forward(module, hidden_states, *patch_grid(module, hidden_states))


def add_rope_offset_hook(rope: torch.nn.Module, cache: "QVGCache", original_processors: dict) -> None:
    hook = RopeOffsetHook(cache, original_processors)
    HookRegistry.check_if_exists_or_initialize(rope).register_hook(hook, ROPE_OFFSET_HOOK)


def remove_rope_offset_hook(rope: torch.nn.Module) -> None:
    registry = getattr(rope, "_diffusers_hook", None)
    if registry is not None:
        registry.remove_hook(ROPE_OFFSET_HOOK, recurse=False)
