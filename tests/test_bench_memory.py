"""scripts/bench_memory.py: its byte counts are the real cache's, and its JSON is what the plot reads."""

import json

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
from script_modules import load_script as load

import diffusers_qvg as dq
from diffusers_qvg.codecs.qvg import backend

# Byte counts depend on a codec's layout only (bits, groups, centroid count and dtype), not on its k-means.
STORAGES = {"bf16": "bf16", "qvg-int2": dq.QVGConfig(num_centroids=16, kmeans_iters=1),
            "qvg-int4": dq.QVGConfig(bits=4, num_centroids=16, kmeans_iters=1)}


@pytest.mark.parametrize("storage", list(STORAGES.values()), ids=list(STORAGES))
@pytest.mark.parametrize("window, sink", [(None, 0), (9, 3)])
def test_counts_are_the_real_caches_memory_report(storage, window, sink):
    """A real cache (2 layers, 2 heads x 64, 10x10 tokens per frame, chunks of 3 frames) run the pipeline's way
    holds exactly the bytes the script computes, after every chunk of a 4-chunk video (with the window:
    the sink, then chunks packed, evicted and their slots reused)."""
    bench = load("bench_memory")
    geo = bench.Geometry(layers=2, heads=2, head_dim=64, height=10, width=10, chunk_frames=3)
    config = bench.pipeline_config(storage, window, sink, latent_frames=12)
    cache = dq.QVGCache(config, num_layers=geo.layers)
    rope = WanRotaryPosEmbed(geo.head_dim, (1, 1, 1), max_seq_len=64)
    latent = torch.zeros(1, 1, geo.chunk_frames, geo.height, geo.width)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad(), backend("torch"):
        for chunk in range(4):
            start = chunk * geo.chunk_frames
            with cache.chunk(start_frame=start, final=True):
                cache.begin_forward(rope, latent, geo.chunk_frames, geo.height, geo.width)
                for layer in cache.layers:
                    k, v = torch.randn(2, 1, geo.chunk_frames * 100, geo.heads, geo.head_dim, generator=g)
                    layer.update(k, k, v)
            report = cache.memory_report()
            expected = bench.cache_bytes(config, geo, start + geo.chunk_frames, dtype=torch.float32)
            assert expected == (report.cache, report.bf16_equivalent), chunk


def test_refuses_what_it_does_not_model():
    bench = load("bench_memory")
    config = dq.CacheConfig(storage="bf16", keep_recent_chunks=1, commit="final-pass")
    with pytest.raises(ValueError, match="keep_recent_chunks=0, commit='final-pass'"):
        bench.cache_bytes(config, bench.Geometry(), 21)


def test_self_forcing_geometry_rows(tmp_path):
    rows = load("bench_memory").main(["--max-frames", "42", "--json", str(tmp_path / "memory.json")])
    at = {(r["storage"], r["setting"], r["latent_frames"]): r for r in rows}
    assert len(rows) == 4 * 2 * 14  # bf16, qvg-int2, qvg-int4, nvfp4
    # 21 latent frames, no window: 7 chunks of 4680 tokens x 12 heads x 128, K and V, 30 layers, in BF16.
    assert at["bf16", "no window", 21]["cache_bytes"] == 30 * 7 * 2 * 4680 * 12 * 128 * 2
    qvg = at["qvg-int2", "no window", 21]
    assert qvg["bf16_bytes"] / qvg["cache_bytes"] == pytest.approx(7.11, abs=0.01)  # docs/benchmarks.md
    fp4 = at["nvfp4", "no window", 21]
    assert fp4["cache_bytes"] == 30 * 7 * 2 * 4680 * 12 * (64 + 8) + 30 * 2 * 7 * 12 * 4  # codes, e4m3 and fp32 scales
    windowed = [at["qvg-int2", "window 21, sink 3", f]["cache_bytes"] for f in (21, 30, 42)]
    assert windowed[0] == windowed[1] == windowed[2]  # the window keeps the cache flat
    assert json.loads((tmp_path / "memory.json").read_text())["rows"] == rows
