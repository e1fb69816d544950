"""diffusers-qvg: Quant VideoGen KV-cache compression for autoregressive video diffusion in diffusers."""

from .cache import CacheConfig, ChunkRewriteSizeError, MemoryReport, QVGCache
from .codecs import (
    BF16Config,
    CodecConfig,
    KIVIConfig,
    NVFP4Config,
    Packed,
    QVGConfig,
    QVGPacked,
    SegmentTable,
    dequantize,
    quantize,
    resolve_codec,
    segment_table,
)
from .installer import attach_cache, disable_qvg, enable_qvg
from .processors import QVGSkyReelsV2AttnProcessor, QVGWanAttnProcessor, processors_for
from .ulysses import VideoGroup, enable_ulysses

__version__ = "0.1.0"

__all__ = [
    "BF16Config",
    "CacheConfig",
    "ChunkRewriteSizeError",
    "CodecConfig",
    "KIVIConfig",
    "MemoryReport",
    "NVFP4Config",
    "Packed",
    "QVGConfig",
    "QVGCache",
    "QVGPacked",
    "QVGSkyReelsV2AttnProcessor",
    "QVGWanAttnProcessor",
    "SegmentTable",
    "VideoGroup",
    "attach_cache",
    "dequantize",
    "disable_qvg",
    "enable_qvg",
    "enable_ulysses",
    "processors_for",
    "quantize",
    "resolve_codec",
    "segment_table",
]
