"""NVFP4 (e2m1 codes, an e4m3 scale per 16 channels, a float32 scale above them): LongLive-2's KV cache.

LongLive-2 (NVlabs/LongLive, ``kv_quant: true``) stores each chunk's K and V as NVFP4 through FourOverSix's
``quantize_to_fp4`` with its ``"mse"`` scale rule ("four over six"): every block of 16 channels tries two
e4m3 scales, one that maps the block's largest magnitude to 6 (the e2m1 maximum) and one that maps it to 4,
and keeps the one with the smaller squared error (4 only where strictly smaller; the errors are compared in
units of the second-level scale, where FourOverSix's absolute float32 squares underflow for tiny tensors);
block scales then span e4m3 up to 256 (``"static-6"``, plain NVFP4, always maps to 6, with scales up to
448). The second-level float32 scale is ``amax / (6 * e4m3 range)``. Here it is taken per (segment, batch,
head) rather than over all heads of a chunk as LongLive-2 does: a head's bytes then do not depend on its
neighbours (head-sharded caches store what one rank would), and a quiet head's block scales stay out of
e4m3's subnormal range.

The arithmetic is NVFP4's as torchao computes it (``nvfp4_quantize``): block scales ``clamp(max|x| / m /
g, 2^-6, 448)`` rounded to e4m3, values multiplied by ``(1 / g) / scale``, clamped to +-6 and rounded to
nearest-even on the e2m1 grid; the sign of a value that rounds to 0 is kept. Codes pack two per byte, the
first channel in the low nibble. 4.5 bits per element (3.56x smaller than BF16), whatever the span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..base import CodecConfig, HeadSlice, Packed, Role, SegmentTable
from ..groups import MAX_ABS_INPUT
from ..kernel_backend import decode_unsupported, input_unsupported, pair_decode_unsupported, use_triton
from ..status import WriteStatus
from .format import (
    BLOCK, E2M1_MAX, E4M3_TINY, SCALE_RULES, NVFP4Packed, ScaleRule, decode_reference, e2m1_codes, e2m1_values, pack_pairs,
)


def second_level_scale(x: torch.Tensor, e4m3_range: float) -> torch.Tensor:
    """``amax / (6 * e4m3 range)`` per (batch, head) of ``x`` [B, N, H, D] as float32 [B, H]; 1 where a head is 0."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=(1, 3)).float()  # max |x|, exact, one reduction
    return torch.where(amax > 0, amax / (E2M1_MAX * e4m3_range), 1.0)


def tree_sum16(e: torch.Tensor) -> torch.Tensor:
    """Sum of the last dim (16) in a fixed pairwise order, the Triton encoder's: a candidate's error is the same
    float32 on every device, so the choice between the scales is too."""
    for _ in range(4):
        e = e[..., 0::2] + e[..., 1::2]
    return e[..., 0]


def encode_blocks_reference(x: torch.Tensor, g: torch.Tensor, scale_rule: ScaleRule) -> tuple[torch.Tensor, torch.Tensor]:
    """The block codes and e4m3 scales of ``x`` [B, N, H, D] under second-level scales ``g`` [B, H] (the CPU path,
    and the Triton encoder's oracle): packed codes [B, N, H, D / 2] uint8, scales [B, N, H, D / 16] e4m3."""
    maxima = SCALE_RULES[scale_rule][1]
    blocks = x.float().unflatten(-1, (-1, BLOCK))  # [B, N, H, D / 16, 16]
    block_max = blocks.abs().amax(dim=-1)
    g_blocks = g[:, None, :, None]
    in_units = blocks / g_blocks[..., None]  # the errors compared in units of g: squares of tiny values underflow
    codes, scale, err = None, None, None
    for mapped_to in maxima:  # each candidate scale; a later one wins only where strictly better
        c_scale = (block_max / mapped_to / g_blocks).clamp(E4M3_TINY, 448.0).to(torch.float8_e4m3fn)
        c_codes = e2m1_codes((blocks * ((1.0 / g_blocks) / c_scale.float())[..., None]).clamp(-E2M1_MAX, E2M1_MAX))
        if len(maxima) == 1:
            return pack_pairs(c_codes), c_scale
        c_err = tree_sum16((e2m1_values(c_codes, torch.float32) * c_scale.float()[..., None] - in_units).square())
        if err is None:
            codes, scale, err = c_codes, c_scale, c_err
        else:
            better = c_err < err
            codes = torch.where(better[..., None], c_codes, codes)
            scale = torch.where(better, c_scale.view(torch.uint8), scale.view(torch.uint8)).view(torch.float8_e4m3fn)
            err = torch.minimum(c_err, err)
    return pack_pairs(codes), scale


@dataclass(frozen=True)
class NVFP4Config(CodecConfig):
    """NVFP4 KV storage, LongLive-2's format (module docstring). ``scale_rule``: ``"four-over-six"``
    (LongLive-2's ``kv_quant_scale_rule: mse``) or ``"static-6"`` (plain NVFP4)."""

    name: ClassVar[str] = "nvfp4"
    max_abs_input: ClassVar[float] = MAX_ABS_INPUT

    scale_rule: ScaleRule = "four-over-six"

    def __post_init__(self) -> None:
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"NVFP4Config.scale_rule={self.scale_rule!r} is invalid: use one of {sorted(SCALE_RULES)}")

    def check_layout(self, x: torch.Tensor, what: str = "x") -> None:
        super().check_layout(x, what)
        if x.shape[-1] % BLOCK:
            raise ValueError(f"head_dim {x.shape[-1]} is not a multiple of NVFP4's {BLOCK}-channel blocks; pad it")

    def allocate(self, *, batch, capacity_tokens, heads, head_dim, num_slots, dtype, device, role="value") -> NVFP4Packed:
        if head_dim % BLOCK:
            raise ValueError(f"head_dim {head_dim} is not a multiple of NVFP4's {BLOCK}-channel blocks; pad it")
        B, T, H, D = batch, capacity_tokens, heads, head_dim
        return NVFP4Packed(
            config=self,
            shape=(B, T, H, D),
            dtype=dtype,
            num_slots=num_slots,
            codes=torch.zeros(B, T, H, D // 2, dtype=torch.uint8, device=device),
            scales=torch.zeros(B, T, H, D // BLOCK, dtype=torch.float8_e4m3fn, device=device),
            tensor_scale=torch.zeros(num_slots, B, H, dtype=torch.float32, device=device),
        )

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [B, N, H, D] as (packed codes, e4m3 block scales, float32 second-level scales [B, H]): the Triton
        encoder on CUDA (bit-identical), the reference elsewhere."""
        g = second_level_scale(x, SCALE_RULES[self.scale_rule][0])
        if use_triton(x.device, input_unsupported(x)):
            from .triton_encode import encode_blocks
        else:
            encode_blocks = encode_blocks_reference
        codes, scales = encode_blocks(x, g, self.scale_rule)
        return codes, scales, g

    def quantize_into(
        self,
        storage: NVFP4Packed,
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
        unchecked = self.check_write(x, status, what)
        packed, scales, g = self.encode(x)
        rows = slice(token_start, token_start + x.shape[1])
        for dst, src in ((storage.codes[:, rows], packed), (storage.scales[:, rows], scales), (storage.tensor_scale[slot], g)):
            if unchecked:
                dst.copy_(src)
            else:
                status.gated_copy_(dst.view(torch.uint8), src.view(torch.uint8))

    def dequantize_into(self, storage: NVFP4Packed, segments: SegmentTable, out: torch.Tensor, rotary=None) -> None:
        self.check_segments(storage, segments, out, rotary)
        if use_triton(out.device, decode_unsupported(out, rotary)):
            from .triton_decode import dequantize_into

            dequantize_into(storage, segments, out, rotary)
        else:
            decode_reference(storage, segments, out, rotary)

    def dequantize_pair_into(self, key_storage, value_storage, segments, key_out, value_out, rotary=None) -> None:
        """Keys (rotated) and values of one table in one Triton launch (see :meth:`CodecConfig.dequantize_pair_into`)."""
        self.check_segments(key_storage, segments, key_out, rotary)
        self.check_segments(value_storage, segments, value_out)
        if use_triton(key_out.device, pair_decode_unsupported(key_out, value_out, rotary)):
            from .triton_decode import dequantize_pair_into

            dequantize_pair_into(key_storage, value_storage, segments, key_out, value_out, rotary)
        else:
            decode_reference(key_storage, segments, key_out, rotary)
            decode_reference(value_storage, segments, value_out)
