"""Choose the QVG kernels, Triton or the PyTorch reference, by :mod:`..kernel_backend`'s rule."""

from __future__ import annotations

import torch

from ...rotary import Rotary
from ..base import SegmentTable
from ..kernel_backend import decode_unsupported, input_unsupported, pair_decode_unsupported, use_triton
from .format import QVGPacked
from .settings import QVGSettings


def dequantize_into(storage: QVGPacked, segments: SegmentTable, out: torch.Tensor, rotary: Rotary | None = None) -> None:
    if use_triton(out.device, decode_unsupported(out, rotary)):
        from .triton.dequantize import dequantize_into as run
    else:
        from .decode import dequantize_into as run
    run(storage, segments, out, rotary)


def dequantize_pair_into(
    key_storage: QVGPacked,
    value_storage: QVGPacked,
    segments: SegmentTable,
    key_out: torch.Tensor,
    value_out: torch.Tensor,
    rotary: Rotary | None = None,
) -> None:
    """Keys (rotated) and values: one Triton launch, or the reference twice."""
    if use_triton(key_out.device, pair_decode_unsupported(key_out, value_out, rotary)):
        from .triton.dequantize import dequantize_pair_into

        dequantize_pair_into(key_storage, value_storage, segments, key_out, value_out, rotary)
    else:
        from .decode import dequantize_into as run

        run(key_storage, segments, key_out, rotary)
        run(value_storage, segments, value_out)


def use_triton_encoder(config: QVGSettings, x: torch.Tensor) -> bool:
    """The Triton encoder (deterministic, sync-free) on CUDA, the reference elsewhere.

    The Triton kernels need float32 math (no float64 input) and a power-of-two group size.
    """
    unsupported = input_unsupported(x)
    if unsupported is None and config.group_size & (config.group_size - 1):
        unsupported = f"group_size {config.group_size} (powers of two only)"
    return use_triton(x.device, unsupported)
