"""Codec quality benchmark on video-derived K/V at Self-Forcing geometry (issue 2): prints a markdown table.

    python scripts/bench_codec.py            # 7 chunks of 4680 tokens, 12 heads x 128 (a few minutes on CPU)
    python scripts/bench_codec.py --small    # tiny sizes, seconds (tests)
    python scripts/bench_codec.py --only qvg-int2 official-int2
    python scripts/bench_codec.py --json docs/bench_codec.json   # also the rows as JSON (scripts/plot_benchmarks.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import shlex
import sys
import time

import torch

import diffusers_qvg as dq
from diffusers_qvg.codec_quality import CodecQuality, attention_probe, measure_codec
from diffusers_qvg.codecs import PRESETS
from diffusers_qvg.video_kv import VideoKVSpec, video_kv

SMALL = VideoKVSpec(height=64, width=96, patch=8, heads=2, head_dim=64)  # 288 tokens/chunk: >= 256 centroids


def codec_rows() -> dict[str, tuple[dq.CodecConfig, bool]]:
    """Name -> (codec, warm start): every registry preset, the official settings, and variants worth showing."""
    official = dq.QVGConfig.official()
    rows = {name: (dq.resolve_codec(name), False) for name in PRESETS}
    rows |= {
        "qvg-int4-official": (dq.QVGConfig.official(bits=4), False),
        "official + mse scales": (official.with_(scale_search="mse"), False),
        "official + trits": (official.with_(packing="auto"), False),
        "qvg-int2 bf16 centroids": (dq.QVGConfig(centroid_dtype="bfloat16"), False),
        "qvg-int2 k-means++ init": (dq.QVGConfig(kmeans_init="kmeans++"), False),
        "qvg-int2 asymmetric": (dq.QVGConfig(symmetric=False), False),
        "qvg-int2 warm start": (dq.QVGConfig(), True),
        "qvg-int2 128 centroids": (dq.QVGConfig(num_centroids=128), False),
        "qvg-int2 tf32x3 k-means": (dq.QVGConfig(kmeans_precision="tf32x3"), False),
        "qvg-int2 tf32 k-means": (dq.QVGConfig(kmeans_precision="tf32"), False),
        # The encoder's GPU time is mostly Lloyd iterations (docs/benchmarks.md, "Encoder"): fewer of them,
        # from the strided init or warm-started from the previous chunk's centroids.
        "qvg-int2 4 Lloyd iters": (dq.QVGConfig(kmeans_iters=4), False),
        "qvg-int2 3 Lloyd iters": (dq.QVGConfig(kmeans_iters=3), False),
        "qvg-int2 2 Lloyd iters": (dq.QVGConfig(kmeans_iters=2), False),
        "qvg-int2 1 Lloyd iter": (dq.QVGConfig(kmeans_iters=1), False),
        "qvg-int2 0 Lloyd iters": (dq.QVGConfig(kmeans_iters=0), False),
        "qvg-int2 warm start, 1 Lloyd iter": (dq.QVGConfig(kmeans_iters=1), True),
        "qvg-int2 warm start, 0 Lloyd iters": (dq.QVGConfig(kmeans_iters=0), True),
        # The codes kernel's scale search is the encoder's other large cost: half the candidates.
        "qvg-int2 coarse scale search": (dq.QVGConfig(scale_search="mse-coarse"), False),
        "qvg-int2 coarse scale search, 2 Lloyd iters": (dq.QVGConfig(scale_search="mse-coarse", kmeans_iters=2), False),
        # LongLive-2's cache is the preset "nvfp4" (four-over-six scales); plain NVFP4 beside it.
        "nvfp4 static-6": (dq.NVFP4Config(scale_rule="static-6"), False),
        # SGLang's packed QVG cache runs the official encoder with its own defaults: 4 bits, 128 centroids.
        "sglang defaults (official int4, 128 centroids)": (dq.QVGConfig.official(bits=4).with_(num_centroids=128), False),
    }
    return rows


def markdown_table(results: dict[str, CodecQuality]) -> str:
    header = (
        "| codec | bits/elem | vs BF16 | K relL2 | K pre-RoPE relL2 | V relL2 | attn err | sharp attn err "
        "| attn err (K pre-RoPE) | sharp (K pre-RoPE) | quantize ms/chunk | dequantize ms/chunk |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r.bits_per_element:.3f} | {16 / r.bits_per_element:.2f}x | {r.key_rel_l2:.4f} "
            f"| {r.key_pre_rope_rel_l2:.4f} | {r.value_rel_l2:.4f} | {r.attention_error:.4f} "
            f"| {r.sharp_attention_error:.4f} | {r.attention_error_pre_rope:.4f} "
            f"| {r.sharp_attention_error_pre_rope:.4f} | {r.quantize_ms:.1f} | {r.dequantize_ms:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument(
        "--small", action="store_true", help="tiny sizes (64x96 frames, 2 chunks, 2 heads x 64, 64 queries), seconds"
    )
    parser.add_argument("--chunks", type=int, default=7, help="chunks in the window (7 = 21 latent frames)")
    parser.add_argument("--queries", type=int, default=256, help="queries sampled from the last chunk")
    parser.add_argument("--sharpness", type=float, default=4.0, help="query scale for the sharp attention error")
    parser.add_argument("--keep-recent", type=int, default=0,
                        help="finished chunks before the current one left exact in the attention errors (the "
                        "cache's keep_recent_chunks; default 0: every finished chunk is read from the codec)")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch CPU threads (default 1: on a shared CPU, multi-threaded ops wait ~10 ms for descheduled workers)",
    )
    parser.add_argument("--only", nargs="+", metavar="CODEC", help="rows to run (default: all)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and how they were measured to PATH")
    args = parser.parse_args(argv)

    rows = codec_rows()
    unknown = sorted(set(args.only or ()) - set(rows))
    if unknown:
        parser.error(f"unknown codec rows {unknown}; choose from {list(rows)}")
    torch.set_num_threads(args.threads)
    spec = SMALL if args.small else VideoKVSpec()
    chunks = 2 if args.small else args.chunks
    queries = 64 if args.small else args.queries

    start = time.perf_counter()
    data = video_kv(spec, chunks=chunks)
    print(
        f"video-derived K/V: {spec.height}x{spec.width} frames, {spec.tokens_per_chunk} tokens/chunk x {chunks} chunks, "
        f"{spec.heads} heads x {spec.head_dim}, clips {', '.join(spec.clips)}; built in {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    probe = attention_probe(data, queries, args.sharpness)
    results = {}
    for name, (codec, warm) in rows.items():
        if args.only and name not in args.only:
            continue
        results[name] = measure_codec(codec, data, probe, warm_start=warm, keep_recent=args.keep_recent)
        print(f"  {name}: done", file=sys.stderr)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    command = shlex.join(["python", *sys.argv])
    print(f"torch {torch.__version__}, diffusers-qvg {dq.__version__}, {machine}; command: {command}\n")
    print(markdown_table(results))
    if args.json:
        meta = dict(
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), command=command,
            machine=machine, torch=torch.__version__, diffusers_qvg=dq.__version__, clips=list(spec.clips),
            tokens_per_chunk=spec.tokens_per_chunk, chunks=chunks, heads=spec.heads, head_dim=spec.head_dim,
            queries=queries, sharpness=args.sharpness, keep_recent=args.keep_recent,
        )
        rows = [dict(codec=name, **dataclasses.asdict(r)) for name, r in results.items()]
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
