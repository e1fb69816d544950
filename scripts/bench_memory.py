"""Resident KV-cache bytes against video length at Self-Forcing geometry: exact, without a GPU or any K/V.

    python scripts/bench_memory.py --json docs/bench_memory.json     # seconds, on any machine

For each storage (bf16, qvg-int2, qvg-int4), with and without a sliding window (21 latent frames, the first 3
a sink), in the pipeline's cache configuration (``commit="final-pass"``, ``keep_recent_chunks=0``, the pool
sized for the video by ``expected_frames``): the cache's own layout bookkeeping (``ChunkLayout``, which every
layer follows) runs the video chunk by chunk, and each storage the layers then hold is allocated by its codec
on the meta device (``codec.allocate``, the call the cache makes), so the bytes are those of the cache after
the video's last clean-context pass. Wan2.1-1.3B geometry: 30 layers, 12 heads x 128, bf16, 1560 tokens per
latent frame (480x832), chunks of 3 latent frames. Not counted: the per-step workspace (one layer's dense
window of K and V) and the window's RoPE table. ``tests/test_bench_memory.py`` checks the method against a real
cache's ``memory_report()``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from dataclasses import asdict, dataclass

import torch

import diffusers_qvg as dq
from diffusers_qvg.cache.layout import ChunkLayout


@dataclass(frozen=True)
class Geometry:
    layers: int = 30
    heads: int = 12
    head_dim: int = 128
    height: int = 30  # post-patch grid: 480x832 pixels / (8 x 2) per side
    width: int = 52
    chunk_frames: int = 3


SETTINGS = {  # name -> (window_frames, sink_frames)
    "no window": (None, 0),
    "window 21, sink 3": (21, 3),
}


def pipeline_config(storage: str, window_frames: int | None, sink_frames: int, latent_frames: int) -> dq.CacheConfig:
    """The cache ``QVGCausalWanPipeline`` makes for a video of ``latent_frames``."""
    return dq.CacheConfig(storage=storage, window_frames=window_frames, sink_frames=sink_frames, keep_recent_chunks=0,
                          commit="final-pass", expected_frames=latent_frames)


def layout_after(config: dq.CacheConfig, geo: Geometry, latent_frames: int) -> ChunkLayout:
    """The layout after each chunk's denoising forwards and clean-context pass, as the pipeline runs them."""
    layout = ChunkLayout(config)
    for start in range(0, latent_frames, geo.chunk_frames):
        layout, _ = layout.plan(start, geo.chunk_frames, geo.height, geo.width)
        layout, _ = layout.finalize()
    return layout


def kv_bytes(codec: dq.CodecConfig, geo: Geometry, tokens: int, slots: int, batch: int, dtype: torch.dtype) -> int:
    """Bytes of one layer's K and V storage as ``QVGCache.allocate`` asks the codec for it."""
    return sum(
        codec.allocate(batch=batch, capacity_tokens=tokens, heads=geo.heads, head_dim=geo.head_dim, num_slots=slots,
                       dtype=dtype, device="meta", role=role).nbytes
        for role in ("key", "value")
    )


def cache_bytes(config: dq.CacheConfig, geo: Geometry, latent_frames: int, batch: int = 1,
                dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(resident cache bytes, BF16 bytes of the same cached tokens) after a video of ``latent_frames``.

    The storages a layer holds (``LayerCache.apply``): the sink once a chunk entered it, and ``num_blocks``
    packed blocks of ``block_slots`` chunk slots; the pipeline's ``keep_recent_chunks=0`` under
    ``"final-pass"`` holds no ring of unquantized slots.
    """
    if config.keep_recent_chunks or config.current_slots:
        raise ValueError("cache_bytes covers the pipeline's configuration: keep_recent_chunks=0, commit='final-pass'")
    layout = layout_after(config, geo, latent_frames)
    per_layer = layout.num_blocks * kv_bytes(config.storage, geo, layout.block_slots * layout.slot_tokens,
                                             layout.block_slots, batch, dtype)
    if any(c.place == "sink" for c in layout.chunks):
        per_layer += kv_bytes(config.sink_storage, geo, config.sink_frames * layout.tokens_per_frame,
                              config.sink_frames, batch, dtype)
    tokens = sum(c.tokens for c in layout.chunks)
    return geo.layers * per_layer, geo.layers * tokens * 2 * batch * geo.heads * geo.head_dim * 2


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--storages", nargs="+", default=["bf16", "qvg-int2", "qvg-int4", "nvfp4"])
    parser.add_argument("--max-frames", type=int, default=240, help="longest video, latent frames (default 240)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows to PATH (scripts/plot_benchmarks.py)")
    args = parser.parse_args(argv)

    geo = Geometry()
    rows = []
    for storage in args.storages:
        for setting, (window, sink) in SETTINGS.items():
            for frames in range(geo.chunk_frames, args.max_frames + 1, geo.chunk_frames):
                resident, bf16 = cache_bytes(pipeline_config(storage, window, sink, frames), geo, frames)
                rows.append(dict(storage=storage, setting=setting, window_frames=window, sink_frames=sink,
                                 latent_frames=frames, cache_bytes=resident, bf16_bytes=bf16))

    gib = 2**30
    print("| storage | setting | 21 frames GiB | 81 frames GiB | 240 frames GiB | ratio vs BF16 at 240 |")
    print("|---|---|---|---|---|---|")
    for storage in args.storages:
        for setting in SETTINGS:
            at = {r["latent_frames"]: r for r in rows if r["storage"] == storage and r["setting"] == setting}
            sizes = " | ".join(f"{at[f]['cache_bytes'] / gib:.3f}" if f in at else "n/a" for f in (21, 81, 240))
            last = at[max(at)]
            print(f"| {storage} | {setting} | {sizes} | {last['bf16_bytes'] / last['cache_bytes']:.2f}x |")
    if args.json:
        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    command=shlex.join(["python", *sys.argv]), diffusers_qvg=dq.__version__,
                    geometry=asdict(geo), tokens_per_frame=geo.height * geo.width, dtype="bfloat16",
                    cache="QVGCausalWanPipeline's: commit='final-pass', keep_recent_chunks=0, expected_frames=video")
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
