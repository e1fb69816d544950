"""Chunk-by-chunk decoding with the causal Wan VAE, identical to decoding the whole latent video at once.

``AutoencoderKLWan._decode`` already runs its decoder one latent frame at a time, carrying the causal
convolutions' last frames in a feature cache that it clears at the start and the end of every call. Keeping
that cache in this object instead, across chunks, decodes a stream frame by frame exactly as one call over the
concatenated latents would: the first latent frame gives 1 video frame, every later one 4. The pipeline's
``__call__`` and ``stream`` both decode this way, so they return the same frames.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, unpatchify


class StreamingWanDecoder:
    """Decode successive latent chunks [B, z, F, h, w] of one video; :meth:`reset` starts a new video."""

    def __init__(self, vae: AutoencoderKLWan):
        self.vae = vae
        self._num_convs = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        z_dim = vae.config.z_dim
        self._mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1)
        self._inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1)
        self.reset()

    def reset(self) -> None:
        self._feat_cache: list = [None] * self._num_convs
        self.frames_decoded = 0

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1], [B, 3, T, H, W]: 1 + 4 (F - 1) frames for the first chunk, 4 F after."""
        vae = self.vae
        if hasattr(vae, "_hf_hook") and hasattr(vae._hf_hook, "pre_forward"):
            vae._hf_hook.pre_forward(vae)  # model CPU offload moves the VAE in, as ``vae.decode`` would
        device, dtype = vae.post_quant_conv.weight.device, vae.dtype
        z = latents.to(device=device, dtype=dtype)
        z = z / self._inv_std.to(device, dtype) + self._mean.to(device, dtype)
        x = vae.post_quant_conv(z)
        frames = []
        for i in range(x.shape[2]):
            first = self.frames_decoded == 0
            frames.append(vae.decoder(x[:, :, i : i + 1], feat_cache=self._feat_cache, feat_idx=[0], first_chunk=first))
            self.frames_decoded += 1
        out = torch.cat(frames, dim=2)
        if vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=vae.config.patch_size)
        return out.clamp(-1.0, 1.0)
