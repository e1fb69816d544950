"""Attention over a quantized history: bounded error, QVG below RTN at no fewer RTN bytes, warm start."""

from functools import lru_cache

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

import diffusers_qvg as dq
from diffusers_qvg.attention import cached_self_attention
from diffusers_qvg.codecs import PRESETS

B, H, D = 1, 2, 64
HEIGHT = WIDTH = 16  # tokens per frame; patch size 1
FRAMES, CHUNKS = 2, 4  # 512 tokens per chunk
QVG = dq.QVGConfig(num_centroids=16)  # a 512-token chunk cannot feed the preset's 256 centroids
RTN = PRESETS["rtn-int2"]


def video_like(generator, scale, outlier=0.0):
    """Tokens around a few shared per-head modes (video K/V cluster by content), plus outlier channels."""
    centers = torch.randn(H, 12, D, generator=generator) * scale + torch.randn(D, generator=generator) * outlier
    ids = torch.randint(0, 12, (CHUNKS, H, FRAMES * HEIGHT * WIDTH), generator=generator)
    tokens = centers[torch.arange(H)[None, :, None], ids] + 0.15 * torch.randn(*ids.shape, D, generator=generator)
    return tokens.permute(0, 2, 1, 3).unsqueeze(1)  # [CHUNKS, B, N, H, D]


@lru_cache(maxsize=None)
def reference():
    return attend_last_chunk("bf16")[0]


def attend_last_chunk(storage, device="cpu", **options):
    """Write CHUNKS chunks through a one-layer cache; return the last chunk's attention output and the cache."""
    g = torch.Generator().manual_seed(7)
    keys, values = video_like(g, 1.0, outlier=4.0).to(device), video_like(g, 1.0).to(device)
    queries = video_like(g, 1.0).to(device)
    rope = WanRotaryPosEmbed(D, (1, 1, 1), max_seq_len=32).to(device)
    cache = dq.QVGCache(dq.CacheConfig(storage=storage, **options), num_layers=1)
    latent = torch.zeros(B, 1, FRAMES, HEIGHT, WIDTH, device=device)
    for c in range(CHUNKS):
        with cache.chunk(start_frame=c * FRAMES):
            rotary = cache.begin_forward(rope, latent, FRAMES, HEIGHT, WIDTH)
            out = cached_self_attention(cache.layers[0], queries[c], keys[c], values[c], rotary)
    return out, cache


def rel_error(out, ref):
    return ((out - ref).norm() / ref.norm()).item()


@torch.no_grad()
def test_qvg_int2_attention_error_is_bounded_and_below_rtn():
    ref = reference()
    qvg, qvg_cache = attend_last_chunk(QVG)
    rtn, rtn_cache = attend_last_chunk(RTN)
    assert [c.place for c in qvg_cache.layout.chunks] == ["packed", "packed", "recent", "current"]
    qvg_err, rtn_err = rel_error(qvg, ref), rel_error(rtn, ref)
    assert qvg_cache.memory_report().packed <= rtn_cache.memory_report().packed
    assert 0 < qvg_err < 0.05
    assert qvg_err < 0.25 * rtn_err


@torch.no_grad()
def test_warm_start_keeps_the_error_bounded():
    ref = reference()
    out, cache = attend_last_chunk(QVG, warm_start=True, keep_recent_chunks=0)
    assert [c.place for c in cache.layout.chunks] == ["packed", "packed", "packed", "current"]
    assert 0 < rel_error(out, ref) < 0.05


@torch.no_grad()
def test_keys_cached_before_rope_quantize_better_than_after():
    ref = reference()
    before, _ = attend_last_chunk(QVG, keep_recent_chunks=0)
    after, _ = attend_last_chunk(QVG, keys_before_rope=False, keep_recent_chunks=0)
    assert rel_error(before, ref) < 0.5 * rel_error(after, ref)


@torch.no_grad()
@pytest.mark.parametrize(
    "storage, smaller", [("rtn-int4", 4), (dq.KIVIConfig(key_group_tokens=32), 4), ("nvfp4", 3.5)], ids=["rtn-int4", "kivi-int2", "nvfp4"]
)
def test_baseline_storages_plug_in_by_name_or_config(storage, smaller):
    out, cache = attend_last_chunk(storage)
    assert 0 < rel_error(out, reference()) < 0.15
    assert 0 < cache.memory_report().packed < attend_last_chunk("bf16")[1].memory_report().packed / smaller


@torch.no_grad()
def test_sink_storage_is_configurable():
    out, cache = attend_last_chunk("bf16", sink_frames=FRAMES, sink_storage=QVG)
    assert [c.place for c in cache.layout.chunks] == ["sink", "packed", "recent", "current"]
    report = cache.memory_report()
    assert 0 < report.sink < report.current  # one packed sink chunk is smaller than the BF16 current slot
    assert 0 < rel_error(out, reference()) < 0.05
