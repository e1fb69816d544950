"""Choose the QVG kernels, Triton or the PyTorch reference, by :mod:`..kernel_backend`'s rule."""

from __future__ import annotations

import torch

from ...rotary import Rotary
from ..base import SegmentTable
from ..kernel_backend import TRITON_DTYPES, decode_unsupported, use_triton
from .config import QVGConfig
from .format import QVGPacked


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
    unsupported = decode_unsupported(key_out, rotary) or decode_unsupported(value_out, None)
    if use_triton(key_out.device, unsupported):
        from .triton.dequantize import dequantize_pair_into

        dequantize_pair_into(key_storage, value_storage, segments, key_out, value_out, rotary)
    else:
        from .decode import dequantize_into as run

        run(key_storage, segments, key_out, rotary)
        run(value_storage, segments, value_out)


def use_triton_encoder(config: QVGConfig, x: torch.Tensor) -> bool:
    """The Triton encoder (deterministic, sync-free) on CUDA, the reference elsewhere.

    The Triton kernels need float32 math (no float64 input) and a power-of-two group size.
    """
    unsupported = None
    if x.dtype not in TRITON_DTYPES:
        unsupported = f"{x.dtype} input (bfloat16, float16 or float32 only)"
    elif config.group_size & (config.group_size - 1):
        unsupported = f"group_size {config.group_size} (powers of two only)"
    return use_triton(x.device, unsupported)
