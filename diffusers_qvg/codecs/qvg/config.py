"""QVG settings: validated once, so the encoder and kernels can trust every field."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Literal, Sequence

import torch

from ..base import CodecConfig, HeadSlice, Packed, Role, SegmentTable
from ..status import WriteStatus
from ..groups import MAX_ABS_INPUT, SCALE_GRIDS

CentroidDType = Literal["e4m3", "bfloat16", "float16", "float32"]
MAX_CENTROIDS = 2**15  # ids are stored as uint8 (K <= 256) or int16


@dataclass(frozen=True)
class QVGConfig(CodecConfig):
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

    name: ClassVar[str] = "qvg"
    max_abs_input: ClassVar[float] = MAX_ABS_INPUT

    bits: int = 2
    symmetric: bool = True
    packing: Literal["auto", "bits", "trits"] = "auto"
    group_size: int = 64
    scale_dtype: Literal["e4m3", "fp16"] = "e4m3"
    scale_search: Literal["mse", "mse-coarse", "absmax"] = "mse"
    num_centroids: int | None = None
    kmeans_iters: int = 5
    kmeans_init: Literal["kmeans++", "strided", "random"] = "strided"
    kmeans_precision: Literal["tf32x3", "tf32", "bf16"] = "bf16"
    stages: int = 1
    centroid_dtype: CentroidDType = "e4m3"
    centroid_scale: Literal["centroid", "head"] = "head"
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, value, allowed: str) -> ValueError:
            return ValueError(f"QVGConfig.{field}={value!r} is invalid: {allowed}")

        if self.bits not in (2, 4):
            raise bad("bits", self.bits, "use 2 or 4")
        if self.packing not in ("auto", "bits", "trits"):
            raise bad("packing", self.packing, "use 'auto', 'bits' or 'trits'")
        if self.packing == "trits" and not (self.bits == 2 and self.symmetric):
            raise bad("packing", self.packing, "trit packing holds only symmetric 2-bit (ternary) codes")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise bad("group_size", self.group_size, "use a positive number of channels that divides head_dim")
        if self.scale_dtype not in ("e4m3", "fp16"):
            raise bad("scale_dtype", self.scale_dtype, "use 'e4m3' or 'fp16'")
        if self.scale_search not in SCALE_GRIDS:
            raise bad("scale_search", self.scale_search, "use 'mse', 'mse-coarse' or 'absmax'")
        if self.num_centroids is not None and (
            not isinstance(self.num_centroids, int) or not 1 <= self.num_centroids <= MAX_CENTROIDS
        ):
            raise bad(
                "num_centroids", self.num_centroids, f"use an integer in [1, {MAX_CENTROIDS}] (at most the tokens per segment)"
            )
        if not isinstance(self.seed, int):
            raise bad("seed", self.seed, "use an integer")
        if not isinstance(self.kmeans_iters, int) or self.kmeans_iters < 0:
            raise bad("kmeans_iters", self.kmeans_iters, "use 0 or more Lloyd iterations")
        if self.kmeans_init not in ("kmeans++", "strided", "random"):
            raise bad("kmeans_init", self.kmeans_init, "use 'kmeans++', 'strided' or 'random'")
        if self.kmeans_precision not in ("tf32x3", "tf32", "bf16"):
            raise bad("kmeans_precision", self.kmeans_precision, "use 'tf32x3', 'tf32' or 'bf16'")
        if not isinstance(self.stages, int) or self.stages < 0:
            raise bad("stages", self.stages, "use 0 (plain residual codes) or more k-means stages")
        if self.centroid_dtype not in ("e4m3", "bfloat16", "float16", "float32"):
            raise bad("centroid_dtype", self.centroid_dtype, "use 'e4m3', 'bfloat16', 'float16' or 'float32'")
        if self.centroid_scale not in ("centroid", "head"):
            raise bad("centroid_scale", self.centroid_scale, "use 'centroid' or 'head'")

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

    # Derived quantities, one definition each.
    @property
    def centroids(self) -> int:
        if self.num_centroids is not None:
            return self.num_centroids
        return 256 if self.bits == 2 else 64

    @property
    def qmax(self) -> int:
        """Largest code magnitude (symmetric) or largest code (asymmetric)."""
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2**self.bits - 1

    @property
    def trits(self) -> bool:
        return self.packing == "trits" or (self.packing == "auto" and self.bits == 2 and self.symmetric)

    @property
    def group_code_bytes(self) -> int:
        """Bytes of packed codes per group of ``group_size`` channels."""
        if self.trits:
            return math.ceil(self.group_size / 5)
        return math.ceil(self.group_size * self.bits / 8)

    @property
    def id_dtype(self) -> torch.dtype:
        return torch.uint8 if self.centroids <= 256 else torch.int16

    @property
    def scale_torch_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.scale_dtype == "e4m3" else torch.float16

    @property
    def centroid_torch_dtype(self) -> torch.dtype:
        return {
            "e4m3": torch.float8_e4m3fn,
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
            "float32": torch.float32,
        }[self.centroid_dtype]

    def with_(self, **changes) -> "QVGConfig":
        return replace(self, **changes)

    def check_layout(self, x: torch.Tensor, what: str = "x") -> None:
        super().check_layout(x, what)
        D = x.shape[-1]
        if D % self.group_size:
            raise ValueError(
                f"head_dim {D} is not divisible by group_size {self.group_size}; pick a group_size that divides it"
            )
        if self.stages and self.centroids > x.shape[1]:
            raise ValueError(
                f"num_centroids {self.centroids} exceeds the {x.shape[1]} tokens of the segment; "
                "pack longer segments or use fewer centroids"
            )

    # The codec verbs live beside the format they read and write.
    def allocate(self, *, batch, capacity_tokens, heads, head_dim, num_slots, dtype, device, role="value") -> Packed:
        from .format import allocate_qvg

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
        from .dispatch import use_triton_encoder
        from .encode import Write, check_warm_start, quantize_writes

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
        triton = use_triton_encoder(self, items[0][1])  # raises if Triton is forced on inputs it cannot take
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
        from .dispatch import dequantize_into

        self.check_segments(storage, segments, out, rotary)
        dequantize_into(storage, segments, out, rotary)

    def dequantize_pair_into(
        self, key_storage: Packed, value_storage: Packed, segments: SegmentTable, key_out: torch.Tensor,
        value_out: torch.Tensor, rotary=None,
    ) -> None:
        """Keys (rotated) and values of one table in one Triton launch (see :meth:`CodecConfig.dequantize_pair_into`)."""
        from .dispatch import dequantize_pair_into

        self.check_segments(key_storage, segments, key_out, rotary)
        self.check_segments(value_storage, segments, value_out)
        dequantize_pair_into(key_storage, value_storage, segments, key_out, value_out, rotary)


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
