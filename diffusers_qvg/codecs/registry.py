"""Storage formats by name: the one line a new codec adds."""

from __future__ import annotations

from .base import CodecConfig
from .dense import BF16Config
from .kivi import KIVIConfig
from .nvfp4 import NVFP4Config
from .qvg import QVGConfig

PRESETS: dict[str, CodecConfig] = {
    "bf16": BF16Config(),
    "qvg-int2": QVGConfig(),
    "qvg-int4": QVGConfig(bits=4),
    "qvg-int2-official": QVGConfig.official(),
    "rtn-int2": QVGConfig.rtn(),
    "rtn-int2-asym": QVGConfig.rtn(symmetric=False),
    "rtn-int4": QVGConfig.rtn(bits=4),
    "kivi-int2": KIVIConfig(),
    "nvfp4": NVFP4Config(),  # LongLive-2's KV cache (four-over-six scales)
}


def resolve_codec(spec: str | CodecConfig) -> CodecConfig:
    """A codec config from a preset name (``"qvg-int2"``) or a config object."""
    if isinstance(spec, CodecConfig):
        return spec
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec]
    raise ValueError(f"unknown KV cache storage {spec!r}; use one of {sorted(PRESETS)} or a codec config object")
