"""The QVG codec: its settings with the verbs that allocate, pack and read its format (the one public class)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..base import HeadSlice, Packed, Role, SegmentTable
from ..status import WriteStatus
from . import dispatch
from .encode import check_warm_start, quantize_writes
from .format import allocate_qvg
from .settings import QVGSettings
from .write import Write


@dataclass(frozen=True)
class QVGConfig(QVGSettings):
    """Quant VideoGen: per-head k-means smoothing, residual stages, low-bit residual codes.

    ``QVGConfig()`` is the recommended INT2 setting, ``QVGConfig(bits=4)`` the INT4 one, and
    ``QVGConfig.official()`` the official package's configuration (for comparison).

    Fields:
        bits: residual code width, 2 or 4.
        symmetric: symmetric codes ``u - qmax`` (INT2 is then ternary) or asymmetric ``u * s + zero``.
        packing: ``"trits"`` packs ternary codes 5 per byte (1.6 bits); ``"bits"`` packs ``8 // bits`` per
            byte MSB-first (the official layout); ``"auto"`` picks trits for symmetric INT2.
        group_size: channels sharing one residual scale.
        scale_dtype: ``"e4m3"`` (1 byte) or ``"fp16"`` scales, both under a per-head power-of-two shift
            so that no scale underflows or saturates.
        scale_search: ``"mse"`` chooses each group's scale to minimise squared error among 14 fractions of
            its absmax scale (encoder only, no bytes); ``"mse-coarse"`` among 7 (half the codes kernel's
            arithmetic); ``"absmax"`` is the official rule.
        num_centroids: k-means clusters per (batch, head, stage); ``None`` picks 256 for INT2, 64 for INT4.
        kmeans_iters: Lloyd iterations per stage.
        kmeans_init: ``"strided"`` (evenly spaced tokens; free, deterministic, one launch on a GPU: the
            default), ``"kmeans++"`` (greedy D^2 sampling: ~20% lower attention error on video-derived K/V, but
            K sequential steps, ~1,500 small launches per tensor on a GPU: for offline or CPU use) or
            ``"random"`` (the official uniform-with-replacement init, here on a private generator).
        kmeans_precision: the format the Lloyd iterations' assignments multiply points and centroids in:
            ``"bf16"`` (the default: both operands rounded to nearest-even bf16, then one exact tensor-core
            pass, 6x the rate of ``"tf32x3"``; on video-derived K/V its codec quality equals ``"tf32x3"``'s,
            docs/benchmarks.md), ``"tf32"`` (the same in TF32, 2x) or ``"tf32x3"`` (about float32: three TF32
            passes; flash-kmeans on the reference path). The final assignment against the stored table is
            exact in any case.
        stages: progressive residual stages (1 = QVG, 4 = QVG-Pro).
        centroid_dtype: stored centroid precision; ``"e4m3"`` carries a power-of-two scale per centroid
            or per head (``centroid_scale``; per head by default: e4m3's own exponent covers the head's range,
            and it saves 0.014 bits/element on a 4680-token chunk).
        seed: seeds the private generator used by the k-means init; the global RNG is never touched.
    """

    @classmethod
    def official(cls, bits: int = 2) -> "QVGConfig":
        """The official ``quant-videogen`` settings: absmax scales, 2-bit packing, bf16 centroids, T=2, and
        float32-accurate k-means (as flash-kmeans computes it)."""
        return cls(
            bits=bits,
            packing="bits",
            scale_search="absmax",
            num_centroids=256,
            kmeans_iters=2,
            kmeans_init="random",
            kmeans_precision="tf32x3",
            centroid_dtype="bfloat16",
        )

    @classmethod
    def rtn(cls, bits: int = 2, symmetric: bool = True, group_size: int = 64) -> "QVGConfig":
        """Round-to-nearest baseline: no k-means (``stages=0``), absmax fp16 scales per token group.

        Symmetric INT2 is ternary (as in QVG's own residual); codes are packed ``8 // bits`` per byte.
        """
        return cls(
            bits=bits, symmetric=symmetric, packing="bits", group_size=group_size, scale_dtype="fp16",
            scale_search="absmax", stages=0,
        )

    def allocate(self, *, batch, capacity_tokens, heads, head_dim, num_slots, dtype, device, role="value") -> Packed:
        return allocate_qvg(self, batch, capacity_tokens, heads, head_dim, num_slots, dtype, device)

    def quantize_into(
        self,
        storage: Packed,
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
        warm = None if warm_start is None else (warm_start, warm_slot)
        self.quantize_batch_into(
            [(storage, x, token_start, slot)], roles=[role], warm_starts=[warm], status=status, whats=[what],
            heads=heads,
        )

    def quantize_batch_into(
        self,
        items: Sequence[tuple[Packed, torch.Tensor, int, int]],
        *,
        roles: Sequence[Role] | None = None,
        warm_starts: Sequence[tuple[Packed, int] | None] | None = None,
        status: WriteStatus | None = None,
        whats: Sequence[str] | None = None,
        heads: HeadSlice | None = None,
    ) -> None:
        """Pack every item in one launch sequence of the Triton encoder (a fixed number of launches,
        whatever ``len(items)``; the reference packs them one by one). The items must share the input
        shape, dtype and device, and their storages one layout (allocated alike); no two may write the same
        tokens or slot of one storage. Otherwise as :meth:`CodecConfig.quantize_batch_into`.
        """
        roles, warm_starts, whats = self.batch_arguments(items, roles, warm_starts, whats)
        conditions = []
        for (storage, x, token_start, slot), what in zip(items, whats):
            self.check_storage_fits(storage, x, token_start, slot)
            if heads is not None:
                heads.check(x.shape[2], what)
        check_disjoint(items)
        for (storage, x, _, _), warm in zip(items, warm_starts):
            if (x.shape, x.dtype, x.device) != (items[0][1].shape, items[0][1].dtype, items[0][1].device):
                raise ValueError(
                    f"batched items must share one shape, dtype and device: {tuple(x.shape)} {x.dtype} {x.device} "
                    f"vs {tuple(items[0][1].shape)} {items[0][1].dtype} {items[0][1].device}; batch them separately"
                )
            use = warm is not None and self.stages
            conditions.append((check_warm_start(self, storage, *warm),) if use else ())
        triton = dispatch.use_triton_encoder(self, items[0][1])  # raises if Triton is forced on inputs it cannot take
        writes: list[Write] = []
        for (storage, x, token_start, slot), warm, what, must_hold in zip(items, warm_starts, whats, conditions):
            seq = None
            if status is None:
                try:
                    self.check_values(x, what, must_hold)
                except ValueError:
                    if writes:  # as one quantize_into after another: the items before the bad one are written
                        quantize_writes(self, writes, triton=triton, heads=heads)
                    raise
            elif not triton:  # the Triton encoder checks the values itself (no extra pass over them)
                seq = status.check(x, what, self.max_abs_input, must_hold)
            writes.append(Write(storage, x, token_start, slot, seq, warm if self.stages else None))
        checks = holds = None
        if triton and status is not None:
            checks = [(what, [message for _, message in must_hold]) for what, must_hold in zip(whats, conditions)]
            if any(conditions):
                true = torch.ones((), dtype=torch.bool, device=status.device)
                holds = torch.stack([c[0][0] if c else true for c in conditions]).reshape(-1, 1)
        quantize_writes(self, writes, status, checks, holds, triton=triton, heads=heads)

    def dequantize_into(self, storage: Packed, segments: SegmentTable, out: torch.Tensor, rotary=None) -> None:
        self.check_segments(storage, segments, out, rotary)
        dispatch.dequantize_into(storage, segments, out, rotary)

    def dequantize_pair_into(
        self, key_storage: Packed, value_storage: Packed, segments: SegmentTable, key_out: torch.Tensor,
        value_out: torch.Tensor, rotary=None,
    ) -> None:
        """Keys (rotated) and values of one table in one Triton launch (see :meth:`CodecConfig.dequantize_pair_into`)."""
        self.check_segments(key_storage, segments, key_out, rotary)
        self.check_segments(value_storage, segments, value_out)
        dispatch.dequantize_pair_into(key_storage, value_storage, segments, key_out, value_out, rotary)


def check_disjoint(items: Sequence[tuple[Packed, torch.Tensor, int, int]]) -> None:
    """Raise if two items of a batch write the same tokens or slot of one storage (the kernels would race)."""
    for i, (storage, x, start, slot) in enumerate(items):
        for j, (other, y, other_start, other_slot) in enumerate(items[:i]):
            if other is not storage:
                continue
            if slot == other_slot or (start < other_start + y.shape[1] and other_start < start + x.shape[1]):
                raise ValueError(
                    f"items {j} and {i} write the same storage's slot or tokens (slots {other_slot}, {slot}; tokens "
                    f"from {other_start}, {start}); one batch packs disjoint segments, so split the batch"
                )
