"""QVG's residual quantizer: the last step of the encoder, the one the Triton quantize kernel twins."""

from __future__ import annotations

import torch

from ..groups import GroupCodes, quantize_groups
from .settings import QVGSettings


def quantize_residual(r: torch.Tensor, config: QVGSettings) -> GroupCodes:
    """Quantize the residual ``r`` [B, N, H, D] (float32 or float64) in groups of ``config.group_size`` channels.

    Returns codes ``u`` [B, N, H, G, group_size], ``scales``/``zeros`` [B, N, H, G] in the scale dtype and
    the per-(batch, head) power-of-two ``shift`` [B, H]; :func:`~..format.pack_codes` packs ``u``.
    """
    return quantize_groups(
        r.unflatten(-1, (-1, config.group_size)),
        bits=config.bits,
        symmetric=config.symmetric,
        fmt=config.scale_torch_dtype,
        search=config.scale_search,
    )
