"""KIVI (Liu et al., 2024): keys quantized per channel, values per token, asymmetric, fp16 scale and zero.

Keys have outlier *channels*, so each channel of a key gets its own scale and zero over a group of
``key_group_tokens`` consecutive tokens; values are grouped along channels per token, like RTN. Key groups
are aligned to absolute token positions (token ``t`` is in group ``t // key_group_tokens``), so a key
segment must start on a group boundary; its last group may be partial. Scales and zeros are fp16
relative to the same per-(segment, batch, head) power-of-two shift as QVG's (:mod:`.groups`), which keeps
tiny and huge inputs finite. The layout differs by role, so storage is allocated for keys or for values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..rotary import compute_dtype_for, rotary_slice, rotate
from .base import CodecConfig, HeadSlice, Packed, Role, SegmentTable
from .groups import MAX_ABS_INPUT, dequantize_groups, quantize_groups
from .qvg.format import pack_digits, unpack_digits
from .status import WriteStatus


@dataclass
class KIVIPacked(Packed):
    role: Role
    codes: torch.Tensor  # [B, T, H, ceil(D * bits / 8)] uint8, MSB-first along channels
    scales: torch.Tensor  # fp16: keys [B, ceil(T / key_group_tokens), H, D]; values [B, T, H, D / group_size]
    zeros: torch.Tensor  # like scales
    scale_shift: torch.Tensor  # [S, B, H] float32 powers of two

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales, "zeros": self.zeros, "scale_shift": self.scale_shift}


@dataclass(frozen=True)
class KIVIConfig(CodecConfig):
    """KIVI baseline. ``group_size``: channels per value group; ``key_group_tokens``: tokens per key group
    (KIVI uses 32; 40 here so that a 1560-token Wan latent frame holds whole groups)."""

    name: ClassVar[str] = "kivi"
    max_abs_input: ClassVar[float] = MAX_ABS_INPUT

    bits: int = 2
    group_size: int = 32
    key_group_tokens: int = 40

    def __post_init__(self) -> None:
        if self.bits not in (2, 4):
            raise ValueError(f"KIVIConfig.bits={self.bits!r} is invalid: use 2 or 4")
        for field in ("group_size", "key_group_tokens"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KIVIConfig.{field}={value!r} is invalid: use a positive integer")

    @property
    def qmax(self) -> int:
        return 2**self.bits - 1

    def check_layout(self, x: torch.Tensor, what: str = "x") -> None:
        super().check_layout(x, what)
        if x.shape[-1] % self.group_size:
            raise ValueError(
                f"head_dim {x.shape[-1]} is not divisible by group_size {self.group_size}; pick one that divides it"
            )

    def allocate(self, *, batch, capacity_tokens, heads, head_dim, num_slots, dtype, device, role="value") -> KIVIPacked:
        if role not in ("key", "value"):
            raise ValueError(f"role must be 'key' or 'value', got {role!r}")
        if head_dim % self.group_size:
            raise ValueError(f"head_dim {head_dim} is not divisible by group_size {self.group_size}")
        B, T, H, D = batch, capacity_tokens, heads, head_dim
        if role == "key":
            param_shape = (B, math.ceil(T / self.key_group_tokens), H, D)
        else:
            param_shape = (B, T, H, D // self.group_size)
        return KIVIPacked(
            config=self,
            shape=(B, T, H, D),
            dtype=dtype,
            num_slots=num_slots,
            role=role,
            codes=torch.zeros(B, T, H, math.ceil(D * self.bits / 8), dtype=torch.uint8, device=device),
            scales=torch.zeros(param_shape, dtype=torch.float16, device=device),
            zeros=torch.zeros(param_shape, dtype=torch.float16, device=device),
            scale_shift=torch.zeros(num_slots, B, H, dtype=torch.float32, device=device),
        )

    def quantize_into(
        self,
        storage: KIVIPacked,
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
        if role != storage.role:
            raise ValueError(f"this storage was allocated for {storage.role}s, not {role}s; allocate one per role")
        g = self.key_group_tokens
        if role == "key" and token_start % g:
            raise ValueError(
                f"key segments must start on a multiple of key_group_tokens={g}, got token_start={token_start}; "
                "use a key_group_tokens that divides your chunk length"
            )
        if not self.check_write(x, status, what) and not status.ok_on_host():
            return  # the reference path: a failed status is read on the host (a sync on CUDA)
        B, N, H, D = x.shape
        f = compute_dtype_for(x.dtype)
        x = x.to(f)
        if role == "key":  # groups of g tokens per channel; the last group is padded by repeating its last token
            R = math.ceil(N / g)
            padded = torch.cat([x, x[:, -1:].expand(B, R * g - N, H, D)], dim=1)
            groups = padded.view(B, R, g, H, D).permute(0, 1, 3, 4, 2)  # [B, R, H, D, g]
        else:
            groups = x.unflatten(-1, (-1, self.group_size))  # [B, N, H, G, gs]
        codes = quantize_groups(groups, bits=self.bits, symmetric=False, fmt=torch.float16, search="absmax")
        if role == "key":
            u = codes.u.permute(0, 1, 4, 2, 3).reshape(B, R * g, H, D)[:, :N]
            rows = slice(token_start // g, token_start // g + R)
        else:
            u = codes.u.flatten(-2)
            rows = slice(token_start, token_start + N)

        storage.codes[:, token_start : token_start + N] = pack_digits(u, 2**self.bits, 8 // self.bits)
        storage.scales[:, rows] = codes.scales
        storage.zeros[:, rows] = codes.zeros
        storage.scale_shift[slot] = codes.shift

    def dequantize_into(self, storage: KIVIPacked, segments: SegmentTable, out: torch.Tensor, rotary=None) -> None:
        self.check_segments(storage, segments, out, rotary)
        B, _, H, D = storage.shape
        f = compute_dtype_for(storage.dtype)
        for src, n, dst, slot in segments.rows:
            u = unpack_digits(storage.codes[:, src : src + n], 2**self.bits, 8 // self.bits, D)  # [B, n, H, D]
            shift = storage.scale_shift[slot].view(B, 1, H, 1)
            if storage.role == "key":
                rows = torch.arange(src, src + n, device=u.device) // self.key_group_tokens
                params = [storage.scales[:, rows], storage.zeros[:, rows]]  # [B, n, H, D]
                u = u.unsqueeze(-1)
            else:
                params = [storage.scales[:, src : src + n], storage.zeros[:, src : src + n]]
                u = u.unflatten(-1, (-1, self.group_size))
            x = dequantize_groups(u, *params, shift, qmax=self.qmax, symmetric=False, dtype=f).flatten(-2)
            if rotary is not None:
                x = rotate(x, rotary_slice(rotary, dst, dst + n))
            out[:, dst : dst + n].copy_(x)
