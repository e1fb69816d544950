"""Triton kernels for the QVG codec: one operation per file, each bit-compatible with the torch reference."""

from __future__ import annotations

import torch

from ...kernel_backend import INTERPRETING, check_runnable

__all__ = ["INTERPRETING", "as_bits", "centroid_scale_operand", "check_runnable"]


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors the kernels write travel as their uint8 bits, encoded exactly by :mod:`.numerics`."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def centroid_scale_operand(storage) -> tuple[torch.Tensor, list[int]]:
    """The centroid scales and their strides; a per-head scale gets stride 0 along K, so every id reads it.

    Storage without centroid scales gets a dummy the kernels never read.
    """
    scales = storage.centroid_scales
    if scales is None:
        scales = storage.scale_shift.new_ones(1, 1, 1, 1, 1)
    strides = list(scales.stride())
    if scales.shape[-1] == 1:
        strides[-1] = 0
    return scales, strides
