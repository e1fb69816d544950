"""diffusers-qvg: Quant VideoGen KV-cache compression for autoregressive video diffusion in diffusers."""

from .codecs import (
    BF16Config,
    CodecConfig,
    KIVIConfig,
    Packed,
    QVGConfig,
    QVGPacked,
    dequantize,
    quantize,
    resolve_codec,
    segment_table,
)

__version__ = "0.1.0"

__all__ = [
    "BF16Config",
    "CodecConfig",
    "KIVIConfig",
    "Packed",
    "QVGConfig",
    "QVGPacked",
    "dequantize",
    "quantize",
    "resolve_codec",
    "segment_table",
]
