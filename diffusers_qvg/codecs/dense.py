"""The unquantized reference format: tokens stored as they come (BF16 in practice, float64 in tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..rotary import compute_dtype_for, rotary_slice, rotate
from .base import CodecConfig, HeadSlice, Packed, Role, SegmentTable
from .status import WriteStatus


@dataclass
class DensePacked(Packed):
    values: torch.Tensor  # [B, T, H, D] in the input dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"values": self.values}


@dataclass(frozen=True)
class BF16Config(CodecConfig):
    """No quantization: the reference every other format is measured against.

    Stores the input dtype unchanged (BF16 for real models), so a float64 test cache is exact.
    """

    name: ClassVar[str] = "bf16"

    def allocate(self, *, batch, capacity_tokens, heads, head_dim, num_slots, dtype, device, role="value") -> DensePacked:
        values = torch.zeros(batch, capacity_tokens, heads, head_dim, dtype=dtype, device=device)
        return DensePacked(self, (batch, capacity_tokens, heads, head_dim), dtype, num_slots, values)

    def quantize_into(
        self,
        storage: DensePacked,
        x: torch.Tensor,
        *,
        token_start: int,
        slot: int,
        role: Role = "value",
        warm_start: Packed | None = None,
        warm_slot: int = 0,
        status: WriteStatus | None = None,
        what: str = "x",
        heads: HeadSlice | None = None,
    ) -> None:
        self.check_storage_fits(storage, x, token_start, slot)
        dst = storage.values[:, token_start : token_start + x.shape[1]]
        if self.check_write(x, status, what):
            dst.copy_(x)
        else:
            status.gated_copy_(dst, x)

    def dequantize_into(self, storage: DensePacked, segments: SegmentTable, out: torch.Tensor, rotary=None) -> None:
        self.check_segments(storage, segments, out, rotary)
        for src, n, dst, _ in segments.rows:
            tokens = storage.values[:, src : src + n]
            if rotary is not None:
                tokens = rotate(tokens.to(compute_dtype_for(tokens.dtype)), rotary_slice(rotary, dst, dst + n))
            out[:, dst : dst + n].copy_(tokens)
