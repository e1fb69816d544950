"""QVG's settings: validated once, so the format, the encoder and the kernels can trust every field."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch

from ..base import CodecConfig
from ..groups import MAX_ABS_INPUT, SCALE_GRIDS

CentroidDType = Literal["e4m3", "bfloat16", "float16", "float32"]
MAX_CENTROIDS = 2**15  # ids are stored as uint8 (K <= 256) or int16


@dataclass(frozen=True)
class QVGSettings(CodecConfig):
    """QVG's fields, validated once, and what follows from them: what the format, the encoder and the kernels
    read. The codec verbs that use them are :class:`~diffusers_qvg.QVGConfig`'s (``codec.py``), so the
    modules below it import these without importing it (the fields are documented there)."""

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

    def with_(self, **changes) -> "QVGSettings":
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
