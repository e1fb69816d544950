"""Session-wide test setup: without CUDA, Triton kernels run in Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so it is set here, before any test module
imports ``diffusers_qvg`` (whose encoder and decoder import the kernel modules).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
