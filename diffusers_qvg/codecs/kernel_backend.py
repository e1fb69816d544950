"""Where the codecs' kernels run: Triton on CUDA, the PyTorch reference elsewhere, or what a test forces.

``with backend("triton"):`` runs the Triton kernels even on CPU (under ``TRITON_INTERPRET=1``);
``with backend("torch"):`` runs the reference even on CUDA. The choice is per context (thread- and
task-local), so concurrent callers do not see each other's overrides. One switch for every codec with kernels.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Literal

import torch

from ..rotary import Rotary, rotary_tensors

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # read as Triton reads it when the kernels are defined
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

Backend = Literal["triton", "torch"]
_forced: ContextVar[Backend | None] = ContextVar("kernel_backend", default=None)


@contextmanager
def backend(name: Backend) -> Iterator[None]:
    """Force the kernels' backend inside the ``with`` block."""
    if name not in ("triton", "torch"):
        raise ValueError(f"unknown kernel backend {name!r}; use 'triton' or 'torch'")
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
        raise ValueError(f"the Triton kernels do not support this call: {unsupported}; use backend('torch')")
    if forced is not None:
        return forced == "triton"
    return device.type == "cuda" and unsupported is None


def decode_unsupported(out: torch.Tensor, rotary: Rotary | None) -> str | None:
    """Why a Triton window decoder cannot take this call, or None."""
    if out.dtype not in TRITON_DTYPES:
        return f"{out.dtype} workspace (bfloat16, float16 or float32 only)"
    if rotary is not None and any(t.dtype != torch.float32 for t in rotary_tensors(rotary)):
        return "cos/sin that are not float32"
    return None


def pair_decode_unsupported(key_out: torch.Tensor, value_out: torch.Tensor, rotary: Rotary | None) -> str | None:
    """Why a decoder cannot take a layer's keys (rotated) and values in one call, or None."""
    return decode_unsupported(key_out, rotary) or decode_unsupported(value_out, None)


def input_unsupported(x: torch.Tensor) -> str | None:
    """Why a Triton encoder cannot read ``x``, or None."""
    return None if x.dtype in TRITON_DTYPES else f"{x.dtype} input (bfloat16, float16 or float32 only)"


def check_runnable(
    *tensors: torch.Tensor, kernels: str = "the Triton kernels", cpu_fallback: str = "on CPU use the torch backend, or "
) -> None:
    """Kernels run on CUDA tensors, or on CPU under Triton's interpreter; one device for all operands.

    ``kernels`` names whose kernels refuse; ``cpu_fallback`` names a way round other than the interpreter.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devices))}; move them first")
    device = devices.pop()
    if device.type != "cuda" and not INTERPRETING:
        raise ValueError(
            f"{kernels} need CUDA tensors (got {device}); {cpu_fallback}set TRITON_INTERPRET=1 before importing "
            "diffusers_qvg to run them in Triton's interpreter"
        )
