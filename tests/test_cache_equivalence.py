"""Chunk-by-chunk generation through the cache equals one full forward under the equivalent mask."""

import pytest
import torch
from wan_helpers import HEIGHT, WIDTH, reference_forward, tiny_skyreels_v2, tiny_wan, visibility_mask

import diffusers_qvg as dq
from diffusers_qvg.rope_offset import ROPE_OFFSET_HOOK, RopeOffsetHook

STEPS = (900.0, 600.0, 300.0)  # rewrites of the current chunk, then a commit pass at t=0


def generate(model, cache, chunk_frames, sink_frames=0, window_frames=None, seed=1, device="cpu", final_pass=False):
    """Run the autoregressive loop; return the largest difference from the full masked forward.

    ``final_pass``: run the commit pass (t=0) inside ``cache.chunk(..., final=True)``."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(1, 5, 32, generator=g, dtype=torch.float64).to(device)
    clean, start, worst = [], 0, 0.0
    for c, frames in enumerate(chunk_frames):
        mask = visibility_mask(list(chunk_frames[: c + 1]), sink_frames, window_frames).to(device)
        for t in (*STEPS, 0.0):
            x = torch.randn(1, 16, frames, HEIGHT, WIDTH, generator=g, dtype=torch.float64).to(device)
            with cache.chunk(start_frame=start, final=final_pass and t == 0.0):
                out = model(x, torch.tensor([t], dtype=torch.float64, device=device), text).sample
            ref = reference_forward(model, [*clean, x], [0.0] * c + [t], text, mask)
            worst = max(worst, (out - ref).abs().max().item())
        clean.append(x)
        start += frames
    return worst


@torch.no_grad()
@pytest.mark.parametrize("keys_before_rope", [True, False])
def test_four_chunks_match_block_causal_full_forward(keys_before_rope):
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", keys_before_rope=keys_before_rope)
    assert generate(model, cache, [2, 2, 2, 2]) <= 1e-10
    assert [c.place for c in cache.layout.chunks] == ["packed", "packed", "recent", "current"]


@torch.no_grad()
@pytest.mark.parametrize("keep_recent_chunks", [0, 2])
def test_sink_and_sliding_window_match_the_equivalent_mask(keep_recent_chunks):
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", window_frames=7, sink_frames=2, keep_recent_chunks=keep_recent_chunks)
    frames = [2, 2, 2, 2, 2, 2]  # the window holds the sink and the 2 newest chunks (7 frames: 6 fit)
    assert generate(model, cache, frames, sink_frames=2, window_frames=7) <= 1e-10
    assert [c.start_frame for c in cache.layout.chunks] == [0, 8, 10]


@torch.no_grad()
def test_variable_chunk_sizes_with_declared_slot_size():
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", window_frames=6, chunk_frames=2)
    assert generate(model, cache, [1, 2, 2, 2], window_frames=6) <= 1e-10


class NoOffset(RopeOffsetHook):
    """Starts the cached forward but hands the layers RoPE from frame 0, as stock Wan does."""

    def new_forward(self, module, hidden_states):
        super().new_forward(module, hidden_states)
        return self.fn_ref.original_forward(hidden_states)


@torch.no_grad()
def test_without_the_rope_offset_chunks_differ():
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", keys_before_rope=False)
    registry = model.rope._diffusers_hook
    original = registry.get_hook(ROPE_OFFSET_HOOK)
    registry.remove_hook(ROPE_OFFSET_HOOK, recurse=False)
    registry.register_hook(NoOffset(cache, original.original_processors), ROPE_OFFSET_HOOK)
    assert generate(model, cache, [2, 2, 2, 2]) > 1e-3


@torch.no_grad()
def test_cfg_as_one_batch_equals_one_cache_per_branch():
    """The documented CFG choice: both branches in one batch share one cache with batch 2."""
    g = torch.Generator().manual_seed(5)
    text = torch.randn(2, 5, 32, generator=g, dtype=torch.float64)
    models = [tiny_wan() for _ in range(3)]
    caches = [dq.enable_qvg(m, "bf16", window_frames=4) for m in models]
    worst = 0.0
    for c in range(3):
        for t in (500.0, 0.0):
            x = torch.randn(1, 16, 2, HEIGHT, WIDTH, generator=g, dtype=torch.float64)
            outs = []
            for model, cache, xb, tb in zip(models, caches, (x.expand(2, -1, -1, -1, -1), x, x), (text, text[:1], text[1:])):
                with cache.chunk(start_frame=2 * c):
                    outs.append(model(xb, torch.tensor([t] * xb.shape[0]), tb).sample)
            worst = max(worst, (outs[0] - torch.cat(outs[1:])).abs().max().item())
    assert worst <= 1e-12


@torch.no_grad()
@pytest.mark.parametrize("chunk_frames", [4])
def test_skyreels_v2_chunks_match_its_own_diffusion_forcing_forward(chunk_frames):
    """SkyReels-V2 builds the block-causal mask itself (per-frame timesteps, 2-frame blocks): the reference
    is the model's own full forward; a 4-frame chunk also exercises its in-chunk mask over the window."""
    model = tiny_skyreels_v2(frames_per_block=2)
    cache = dq.enable_qvg(model, "bf16")
    assert isinstance(model.blocks[0].attn1.processor, dq.QVGSkyReelsV2AttnProcessor)
    g = torch.Generator().manual_seed(2)
    text = torch.randn(1, 5, 32, generator=g, dtype=torch.float64)
    clean, worst = [], 0.0
    for c in range(3):
        for t in (STEPS[0], 0.0):
            x = torch.randn(1, 16, chunk_frames, HEIGHT, WIDTH, generator=g, dtype=torch.float64)
            with cache.chunk(start_frame=c * chunk_frames):
                out = model(x, torch.tensor([t], dtype=torch.float64), text).sample
            per_frame = torch.tensor([[0.0] * (c * chunk_frames) + [t] * chunk_frames], dtype=torch.float64)
            ref = model(torch.cat([*clean, x], 2), per_frame, text, enable_diffusion_forcing=True).sample
            worst = max(worst, (out - ref[:, :, -chunk_frames:]).abs().max().item())
        clean.append(x)
    assert worst <= 1e-10
