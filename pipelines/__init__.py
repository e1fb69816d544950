"""Autoregressive video pipelines built on diffusers components (installed as ``diffusers_qvg.pipelines``)."""

from .checkpoint import (
    CheckpointKeyError,
    cast_keeping_fp32_modules,
    convert_wan_original_to_diffusers,
    load_causal_wan_transformer,
    read_checkpoint_state_dict,
)
from .pipeline_qvg_causal_wan import QVGCausalWanPipeline
from .random_models import randomize_, self_forcing_scheduler, tiny_components
from .stream_state import QVGStreamState
from .streaming_decoder import StreamingWanDecoder
from .upstream_numerics import disable_upstream_numerics, enable_upstream_numerics

__all__ = [
    "CheckpointKeyError",
    "QVGCausalWanPipeline",
    "QVGStreamState",
    "StreamingWanDecoder",
    "cast_keeping_fp32_modules",
    "convert_wan_original_to_diffusers",
    "disable_upstream_numerics",
    "enable_upstream_numerics",
    "load_causal_wan_transformer",
    "randomize_",
    "read_checkpoint_state_dict",
    "self_forcing_scheduler",
    "tiny_components",
]
