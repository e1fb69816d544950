"""What the Triton window decoders share: a program's share of ``SegmentTable.tiles`` and a launch's host checks.

A decoder's grid is (heads, tiles, batch x roles), heads fastest; role 0 decodes the keys (rotated), role 1 the
values of a pair launch. Offsets inside a tile are int32 from 64-bit per-program bases, hence the checks.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ..rotary import Rotary, rotary_tensors
from .base import INT32_MAX, TILE_TOKENS, SegmentTable
from .kernel_backend import TRITON_DTYPES, check_runnable

MAX_TILES = 65535  # a launch's grid y


@triton.jit
def tile_program(tiles_ptr, ROLES: tl.constexpr):
    """This program's ``(head, batch, is_key, src, dst, tokens, slot)``: indices as int64 (they scale 64-bit
    bases), ``tokens`` as int32."""
    h = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    b = (tl.program_id(2) // ROLES).to(tl.int64)
    key = tl.program_id(2) % ROLES == 0
    src = tl.load(tiles_ptr + tile * 4).to(tl.int64)
    dst = tl.load(tiles_ptr + tile * 4 + 1).to(tl.int64)
    n = tl.load(tiles_ptr + tile * 4 + 2)
    slot = tl.load(tiles_ptr + tile * 4 + 3).to(tl.int64)
    return h, b, key, src, dst, n, slot


def check_window_call(out: torch.Tensor, segments: SegmentTable, per_token: Sequence[torch.Tensor],
                      rotary: Rotary | None) -> tuple[torch.Tensor, ...]:
    """What a decoder launch needs beyond the codec's ``check_segments``: one device, a workspace dtype the kernels
    write, float32 RoPE, a grid that fits, int32 offsets across a tile of every per-token tensor (``per_token``:
    the storage's, ``[B, T, H, ...]``). Returns the rotary tensors."""
    rope = rotary_tensors(rotary) if rotary is not None else ()
    check_runnable(out, segments.tiles, *per_token, *rope)
    if out.dtype not in TRITON_DTYPES:
        raise ValueError(f"the Triton decoder writes bfloat16/float16/float32 workspaces, got {out.dtype}; use the torch backend")
    if any(t.dtype != torch.float32 for t in rope):
        raise ValueError("the Triton decoder rotates with float32 cos/sin (as diffusers' Wan RoPE makes them)")
    if segments.tiles.shape[0] > MAX_TILES:
        raise ValueError(
            f"the table covers {segments.tiles.shape[0]} tiles of {TILE_TOKENS} tokens; one launch takes at most {MAX_TILES} "
            "(16.7 M tokens): decode the window in parts"
        )
    for t in (out, *per_token, *rope):
        if TILE_TOKENS * t.stride(1) + t.stride(-1) * t.shape[-1] > INT32_MAX:
            raise ValueError(
                f"a tensor of shape {tuple(t.shape)} has token stride {t.stride(1)}: a {TILE_TOKENS}-token tile spans "
                "more than 2^31 elements; use contiguous [batch, tokens, heads, head_dim] tensors"
            )
    return rope


def rope_operands(rope: tuple[torch.Tensor, ...], placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A launch's cos and sin operands: a RotaryPairs table as both, dense (cos, sin) as given, or, without RoPE,
    a placeholder the kernel never reads."""
    if len(rope) == 1:
        return rope[0], rope[0]
    return rope if rope else (placeholder, placeholder)


def one_launch_fits(keys: tuple[Sequence[torch.Tensor], Sequence[int]], values: tuple[Sequence[torch.Tensor], Sequence[int]]) -> bool:
    """Whether a layer's key and value operands (a decoder's ``(tensors, launch strides)``) can share one launch:
    the same strides, and tensors of the same dtypes and shapes."""
    (k_tensors, k_strides), (v_tensors, v_strides) = keys, values
    return list(k_strides) == list(v_strides) and all(
        k.dtype == v.dtype and k.shape == v.shape for k, v in zip(k_tensors, v_tensors, strict=True))

