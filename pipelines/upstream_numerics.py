"""Upstream Wan numerics on a diffusers ``WanTransformer3DModel``, through diffusers ``ModelHook``s.

Self-Forcing and its relatives run the original Wan code, which differs from diffusers in two places that
matter in bfloat16: the Q/K RMS norms compute their statistic in float32 and round to the input dtype
*before* the weight multiply, and the sinusoidal timestep embedding is computed in float64. The hooks below
reproduce both on the model's own modules (nothing global is patched) and can be removed again.
"""

from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.embeddings import Timesteps

RMS_HOOK = "qvg_upstream_fp32_rms"
TIMESTEP_HOOK = "qvg_upstream_fp64_timestep"


class FP32RMSNormHook(ModelHook):
    """``WanRMSNorm``: ``(x.float() * rsqrt(mean(x.float()^2) + eps)).type_as(x) * weight``."""

    def new_forward(self, module: torch.nn.RMSNorm, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        eps = module.eps if module.eps is not None else torch.finfo(hidden_states.dtype).eps
        normed = (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)).type_as(hidden_states)
        return normed * module.weight if module.weight is not None else normed


class FP64TimestepHook(ModelHook):
    """Wan's ``sinusoidal_embedding_1d``: ``[cos, sin](t * 10000^(-i/half))`` in float64.

    The float64 result is cast to the time embedder's dtype by ``WanTimeTextImageEmbedding`` itself.
    """

    def new_forward(self, module: Timesteps, timesteps: torch.Tensor) -> torch.Tensor:
        half = module.num_channels // 2
        exponent = torch.arange(half, dtype=torch.float64, device=timesteps.device) / half
        angles = timesteps.to(torch.float64)[:, None] * torch.pow(10000.0, -exponent)[None, :]
        return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def _qk_norms(transformer: WanTransformer3DModel) -> list[torch.nn.RMSNorm]:
    return [
        norm
        for block in transformer.blocks
        for attn in (block.attn1, block.attn2)
        for norm in (attn.norm_q, attn.norm_k)
        if isinstance(norm, torch.nn.RMSNorm)
    ]


def enable_upstream_numerics(transformer: WanTransformer3DModel) -> WanTransformer3DModel:
    """Install the fp32 Q/K-norm and fp64 timestep-embedding hooks (idempotent)."""
    proj = transformer.condition_embedder.timesteps_proj
    if not (proj.flip_sin_to_cos and proj.downscale_freq_shift == 0 and proj.scale == 1 and proj.num_channels % 2 == 0):
        raise ValueError(
            "enable_upstream_numerics expects Wan's timestep projection (flip_sin_to_cos=True, downscale_freq_shift=0, "
            f"scale=1, even channels); this model has flip_sin_to_cos={proj.flip_sin_to_cos}, "
            f"downscale_freq_shift={proj.downscale_freq_shift}, scale={proj.scale}, channels={proj.num_channels}"
        )
    for module, hook_cls, name in [(proj, FP64TimestepHook, TIMESTEP_HOOK)] + [
        (norm, FP32RMSNormHook, RMS_HOOK) for norm in _qk_norms(transformer)
    ]:
        registry = HookRegistry.check_if_exists_or_initialize(module)
        if registry.get_hook(name) is None:
            registry.register_hook(hook_cls(), name)
    return transformer


def disable_upstream_numerics(transformer: WanTransformer3DModel) -> WanTransformer3DModel:
    """Remove the hooks of :func:`enable_upstream_numerics`; diffusers' own numerics apply again."""
    for module, name in [(transformer.condition_embedder.timesteps_proj, TIMESTEP_HOOK)] + [
        (norm, RMS_HOOK) for norm in _qk_norms(transformer)
    ]:
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None and registry.get_hook(name) is not None:
            registry.remove_hook(name, recurse=False)
    return transformer
