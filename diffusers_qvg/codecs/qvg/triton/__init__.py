"""Triton kernels for the QVG codec: one operation per file, each bit-compatible with the torch reference."""

from __future__ import annotations

import os

import torch


def check_runnable(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU under Triton's interpreter; one device for all operands."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devices))}; move them first")
    device = devices.pop()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the Triton QVG kernels need CUDA tensors (got {device}); on CPU use the torch backend, or set "
            "TRITON_INTERPRET=1 before importing diffusers_qvg to run them in Triton's interpreter"
        )
