"""NVFP4's bytes and what they mean: e2m1 codes two per byte, e4m3 block scales, a float32 scale per slot and
head; the rounding onto the e2m1 grid and the reference decoder (the CPU path, and the Triton kernel's oracle).
How the scales are chosen is :mod:`.codec`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ...rotary import compute_dtype_for, rotary_slice, rotate
from ..base import Packed, SegmentTable

BLOCK = 16  # channels per e4m3 scale
# The e2m1 magnitudes in code order (a code's low three bits; bit 3 is the sign), and the midpoints between them.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_MAX = 6.0
E4M3_TINY = 2.0**-6  # the smallest normal e4m3: torchao's floor for a block scale
# Per scale rule: the e4m3 range the block scales may use, and the magnitudes a block's largest value may map to.
SCALE_RULES: dict[str, tuple[float, tuple[float, ...]]] = {"static-6": (448.0, (6.0,)), "four-over-six": (256.0, (6.0, 4.0))}
ScaleRule = Literal["static-6", "four-over-six"]


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Round float32 ``y`` (|y| <= 6) to nearest-even on the e2m1 grid: uint8 codes, sign in bit 3."""
    a = y.abs()
    midpoints = torch.tensor(E2M1_MIDPOINTS, dtype=a.dtype, device=a.device)
    index = torch.bucketize(a, midpoints)  # midpoints below |y|: a tie lands on the lower neighbour
    tie = midpoints[index.clamp(max=len(E2M1_MIDPOINTS) - 1)] == a
    index = index + (tie & (index % 2 == 1)).to(index.dtype)  # ...unless that one's mantissa bit is odd
    return (index | (torch.signbit(y).to(index.dtype) << 3)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of uint8 e2m1 codes (bit 3 the sign), exactly, in ``dtype``."""
    grid = torch.tensor(E2M1_GRID, dtype=dtype, device=codes.device)
    table = torch.cat([grid, -grid])
    return table[codes.long()]


def pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    """Block codes [..., D / 16, 16] as bytes [..., D / 2], two per byte, the first in the low nibble."""
    pairs = codes.flatten(-2).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


@dataclass
class NVFP4Packed(Packed):
    codes: torch.Tensor  # [B, T, H, D / 2] uint8, two e2m1 codes per byte (first channel low)
    scales: torch.Tensor  # [B, T, H, D / 16] float8_e4m3fn block scales
    tensor_scale: torch.Tensor  # [S, B, H] float32: amax / (6 * e4m3 range) per slot

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales, "tensor_scale": self.tensor_scale}


def decode_reference(storage: NVFP4Packed, segments: SegmentTable, out: torch.Tensor, rotary=None) -> None:
    """The reference decoder (the CPU path, and the Triton kernel's oracle): each row of the table in turn."""
    B, _, H, D = storage.shape
    f = compute_dtype_for(storage.dtype)
    for src, n, dst, slot in segments.rows:
        packed = storage.codes[:, src : src + n]
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)  # [B, n, H, D]
        scale = storage.scales[:, src : src + n].to(f) * storage.tensor_scale[slot].to(f).view(B, 1, H, 1)
        x = (e2m1_values(codes, f).unflatten(-1, (-1, BLOCK)) * scale[..., None]).flatten(-2)
        if rotary is not None:
            x = rotate(x, rotary_slice(rotary, dst, dst + n))
        out[:, dst : dst + n].copy_(x)
