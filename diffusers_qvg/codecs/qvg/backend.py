"""Choose the QVG kernels: Triton on CUDA, the PyTorch reference elsewhere, or what a test forces.

``with backend("triton"):`` runs the Triton kernels even on CPU (under ``TRITON_INTERPRET=1``);
``with backend("torch"):`` runs the reference even on CUDA. The choice is per context (thread- and
task-local), so concurrent callers do not see each other's overrides.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Literal

import torch

from ...rotary import Rotary, rotary_tensors
from ..base import SegmentTable
from .config import QVGConfig
from .format import QVGPacked

Backend = Literal["triton", "torch"]
_forced: ContextVar[Backend | None] = ContextVar("qvg_backend", default=None)
_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@contextmanager
def backend(name: Backend) -> Iterator[None]:
    """Force the QVG kernels' backend inside the ``with`` block."""
    if name not in ("triton", "torch"):
        raise ValueError(f"unknown QVG backend {name!r}; use 'triton' or 'torch'")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def use_triton(device: torch.device, unsupported: str | None) -> bool:
    """Triton when forced, else on CUDA for the inputs the kernels support (float64 stays on the reference).

    ``unsupported`` says why the kernels cannot take this call (None when they can); forcing Triton on
    such a call raises before anything is written.
    """
    forced = _forced.get()
    if forced == "triton" and unsupported:
        raise ValueError(f"the Triton QVG kernels do not support this call: {unsupported}; use backend('torch')")
    if forced is not None:
        return forced == "triton"
    return device.type == "cuda" and unsupported is None


def _decode_unsupported(out: torch.Tensor, rotary: Rotary | None) -> str | None:
    """Why the Triton decoder cannot take this call, or None."""
    if out.dtype not in _TRITON_DTYPES:
        return f"{out.dtype} workspace (bfloat16, float16 or float32 only)"
    if rotary is not None and any(t.dtype != torch.float32 for t in rotary_tensors(rotary)):
        return "cos/sin that are not float32"
    return None


def dequantize_into(storage: QVGPacked, segments: SegmentTable, out: torch.Tensor, rotary: Rotary | None = None) -> None:
    if use_triton(out.device, _decode_unsupported(out, rotary)):
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
    unsupported = _decode_unsupported(key_out, rotary) or _decode_unsupported(value_out, None)
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
    if x.dtype not in _TRITON_DTYPES:
        unsupported = f"{x.dtype} input (bfloat16, float16 or float32 only)"
    elif config.group_size & (config.group_size - 1):
        unsupported = f"group_size {config.group_size} (powers of two only)"
    return use_triton(x.device, unsupported)
