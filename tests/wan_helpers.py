"""A tiny float64 Wan transformer and its block-causal full-sequence reference, for cache tests."""

from __future__ import annotations

import torch
from diffusers import SkyReelsV2Transformer3DModel, WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from diffusers_qvg.pipelines.random_models import WAN_1_3B_TRANSFORMER_CONFIG

HEIGHT = WIDTH = 4  # latent pixels: a 2x2 patch grid, 4 tokens per frame
TOKENS_PER_FRAME = (HEIGHT // 2) * (WIDTH // 2)
HEADS, HEAD_DIM = 2, 12

TINY_CONFIG = dict(
    WAN_1_3B_TRANSFORMER_CONFIG,
    num_attention_heads=HEADS,
    attention_head_dim=HEAD_DIM,
    text_dim=32,
    ffn_dim=32,
    num_layers=2,
    rope_max_seq_len=32,
)


def build(model_cls, dtype: torch.dtype, seed: int, **extra):
    """``model_cls`` from the tiny config; diffusers draws initial weights from the global RNG, so it is
    forked and seeded here and left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(**{**TINY_CONFIG, **extra})
    return model.to(dtype).eval()


def tiny_wan(dtype: torch.dtype = torch.float64, seed: int = 0) -> WanTransformer3DModel:
    return build(WanTransformer3DModel, dtype, seed)


class MaskedSelfAttention(WanAttnProcessor):
    """The stock processor with a fixed self-attention mask (cross-attention untouched)."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.mask = mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        mask = self.mask if encoder_hidden_states is None else None
        return super().__call__(attn, hidden_states, encoder_hidden_states, mask, rotary_emb)


def visibility_mask(chunk_frames: list[int], sink_frames: int = 0, window_frames: int | None = None) -> torch.Tensor:
    """Token mask [S, S] of the cache's policy: a chunk sees itself, the sink chunks, and the newest earlier
    chunks that fit in the window together with the sink (whole chunks)."""
    starts = torch.tensor([0, *chunk_frames]).cumsum(0)
    n = len(chunk_frames)
    seen = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        budget = None if window_frames is None else window_frames - sink_frames
        for k in range(q, -1, -1):
            in_sink = starts[k + 1] <= sink_frames
            if in_sink or budget is None or chunk_frames[k] <= budget:
                seen[q, k] = True
                if not in_sink and budget is not None:
                    budget -= chunk_frames[k]
            else:
                budget = -1  # older chunks are evicted
    ids = torch.repeat_interleave(torch.arange(n), torch.tensor(chunk_frames) * TOKENS_PER_FRAME)
    return seen[ids[:, None], ids[None, :]]


def reference_forward(model, latents: list[torch.Tensor], timesteps: list[float], text: torch.Tensor, mask) -> torch.Tensor:
    """One full forward over all chunks with per-token timesteps and ``mask``; returns the last chunk's output."""
    x = torch.cat(latents, dim=2)
    t = torch.cat(
        [
            torch.full((x.shape[0], c.shape[2] * TOKENS_PER_FRAME), v, dtype=x.dtype, device=x.device)
            for c, v in zip(latents, timesteps)
        ],
        dim=1,
    )
    original = dict(model.attn_processors)
    model.set_attn_processor(MaskedSelfAttention(mask))
    try:
        out = model(x, t, text).sample
    finally:
        model.set_attn_processor(original)
    return out[:, :, -latents[-1].shape[2] :]


def tiny_skyreels_v2(frames_per_block: int, dtype: torch.dtype = torch.float64, seed: int = 0):
    """The SkyReels-V2 twin of :func:`tiny_wan`, block-causal over ``frames_per_block`` latent frames."""
    return build(SkyReelsV2Transformer3DModel, dtype, seed, num_frame_per_block=frames_per_block)
