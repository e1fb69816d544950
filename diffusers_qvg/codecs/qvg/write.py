"""One segment to pack: the record the encoder's driver hands to the reference and to the Triton encoder."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..base import Packed
from .format import QVGPacked


class Write(NamedTuple):
    """One segment to pack: ``x`` [B, N, H, D] into ``storage`` tokens ``[token_start, token_start + N)`` and
    ``slot``. ``seq`` is its place among the write status's checks (a device scalar; None: unchecked or
    checked by the Triton encoder itself); ``warm`` an earlier (storage, slot) whose centroids seed this one."""

    storage: QVGPacked
    x: torch.Tensor
    token_start: int
    slot: int
    seq: torch.Tensor | None = None
    warm: tuple[Packed, int] | None = None
