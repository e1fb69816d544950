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

from .format import QVGPacked

Backend = Literal["triton", "torch"]
_forced: ContextVar[Backend | None] = ContextVar("qvg_backend", default=None)
_TRITON_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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


def use_triton(device: torch.device, supported: bool) -> bool:
    """Triton when forced, else on CUDA for the inputs the kernels support (float64 stays on the reference)."""
    forced = _forced.get()
    if forced is not None:
        return forced == "triton"
    return device.type == "cuda" and supported


def dequantize_into(
    storage: QVGPacked,
    segments: torch.Tensor,
    out: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    supported = out.dtype in _TRITON_OUT_DTYPES and (rotary is None or all(t.dtype == torch.float32 for t in rotary))
    if use_triton(out.device, supported):
        from .triton.dequantize import dequantize_into as run
    else:
        from .decode import dequantize_into as run
    run(storage, segments, out, rotary)
