"""KV storage formats behind one interface (:class:`CodecConfig`), and the public quantize/dequantize."""

from __future__ import annotations

import torch

from .base import CodecConfig, Packed, Role, SegmentTable, segment_table
from .dense import BF16Config, DensePacked
from .kivi import KIVIConfig, KIVIPacked
from .nvfp4 import NVFP4Config, NVFP4Packed
from .qvg import QVGConfig, QVGPacked
from .registry import PRESETS, resolve_codec


def quantize(x: torch.Tensor, config: CodecConfig | str | None = None, *, role: Role = "value", warm_start: Packed | None = None) -> Packed:
    """Pack ``x`` [batch, tokens, heads, head_dim]; ``config`` defaults to ``QVGConfig()``.

    ``role`` matters only to formats that treat keys and values differently (KIVI).
    """
    codec = QVGConfig() if config is None else resolve_codec(config)
    return codec.quantize(x, role=role, warm_start=warm_start)


def dequantize(packed: Packed) -> torch.Tensor:
    """Decode a :func:`quantize` result to the shape and dtype of its input."""
    return packed.config.dequantize(packed)


__all__ = [
    "BF16Config",
    "CodecConfig",
    "DensePacked",
    "KIVIConfig",
    "KIVIPacked",
    "NVFP4Config",
    "NVFP4Packed",
    "PRESETS",
    "Packed",
    "QVGConfig",
    "QVGPacked",
    "Role",
    "SegmentTable",
    "dequantize",
    "quantize",
    "resolve_codec",
    "segment_table",
]
