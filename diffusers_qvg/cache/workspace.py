"""The dense K/V window that every layer decodes into: one per cache, shared by all layers.

Only one layer attends at a time, so one buffer pair serves them all; it is sized once for the largest
window and reused, so steady-state generation allocates nothing.
"""

from __future__ import annotations

import torch


class Workspace:
    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def reserve(self, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Make room for ``numel`` elements per tensor (allocates only to grow); True if it allocated."""
        if self.keys is not None and self.keys.numel() >= numel:
            return False
        self.keys = torch.empty(numel, dtype=dtype, device=device)
        self.values = torch.empty(numel, dtype=dtype, device=device)
        return True

    def views(self, shape: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``[B, W, H, D]`` views of the front of the buffers."""
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        return self.keys[:numel].view(shape), self.values[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return 2 * self.keys.numel() * self.keys.element_size()

    def release(self) -> None:
        self.keys = self.values = None
