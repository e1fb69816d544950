"""Triton kernels for the QVG codec: one operation per file, each bit-compatible with the torch reference."""

from __future__ import annotations

import os

import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # read as Triton reads it when the kernels are defined


def check_runnable(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU under Triton's interpreter; one device for all operands."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devices))}; move them first")
    device = devices.pop()
    if device.type != "cuda" and not INTERPRETING:
        raise ValueError(
            f"the Triton QVG kernels need CUDA tensors (got {device}); on CPU use the torch backend, or set "
            "TRITON_INTERPRET=1 before importing diffusers_qvg to run them in Triton's interpreter"
        )


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
