"""One layer's cached self-attention step: dense BF16 window vs the cache with each storage, in one run.

Self-Forcing geometry by default (12 heads x 128, 3-frame chunks of 1560 tokens per frame, windows of
6/12/21/42 latent frames). A step is one denoising rewrite of the current chunk in one layer: write the
chunk's K/V, make the window's keys and values available, attend. The anchor ("dense") is what the
Self-Forcing family does: copy K/V into a preallocated dense cache and run attention over the window.
``cache:<storage>`` runs the same step through ``LayerCache.update`` + ``dispatch_attention_fn``, in each cache
configuration: ``enable_qvg``'s defaults (every forward stores the chunk in a BF16 slot, one finished chunk
kept BF16) and the pipeline's (``commit="final-pass"``: a denoising step stores nothing; every finished chunk
packed). Every figure is a median over warm repeats; ratios are against the anchor measured in the same run.
A row that fails is recorded with its error and the run goes on.

``--attention`` names the attention the rows run: ``dispatch`` (diffusers' ``dispatch_attention_fn`` with its
default backend, the anchor's) and ``sageattention-1.0.6`` (SageAttention 1's Triton kernels: int8 Q K, fp16
P V; issue 8's design 3, whose error over the window is within 1.05x of BF16's). Its rows, the dense window
and the caches, are held against the same anchor: below 1.0x is faster than BF16 attention.

    python scripts/bench_attention.py                       # on a GPU
    python scripts/bench_attention.py --attention dispatch sageattention-1.0.6
    python scripts/bench_attention.py --small --device cpu  # the CPU smoke run the tests use
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

import diffusers_qvg as dq
from diffusers_qvg.sageattention_1 import sageattention_1

FULL = dict(heads=12, head_dim=128, height=30, width=52, chunk_frames=3, windows=(6, 12, 21, 42))
SMALL = dict(heads=2, head_dim=64, height=8, width=16, chunk_frames=2, windows=(4, 8))
# Cache configurations by name: enable_qvg's defaults, and QVGCausalWanPipeline's.
CONFIGS = {
    "on-advance, keep 1": dict(commit="on-advance", keep_recent_chunks=1),
    "pipeline: final-pass, keep 0": dict(commit="final-pass", keep_recent_chunks=0),
}
# Attention by name, [B, n, H, D] query over [B, tokens, H, D] keys and values; the anchor runs the first.
ATTENTION = {"dispatch": dispatch_attention_fn, "sageattention-1.0.6": sageattention_1}
ANCHOR = "dispatch"


@dataclass
class Row:
    window_frames: int
    variant: str
    config: str
    attention: str
    ms: float
    ratio: float
    step_peak_mib: float | None
    resident_mib: float
    workspace_mib: float
    error: str | None = None


def timed(step, device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``step()`` over ``repeats`` warm calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def step_peak_mib(step, device: torch.device) -> float | None:
    """Memory a step allocates above what was resident before it (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def chunk_tensors(g, geo, dtype, device, n):
    shape = (n, 1, geo["chunk_frames"] * geo["height"] * geo["width"], geo["heads"], geo["head_dim"])
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)


def bench_window(window, storages, configs, attentions, geo, dtype, device, warmup, repeats) -> list[Row]:
    g = torch.Generator().manual_seed(window)
    chunks = window // geo["chunk_frames"]
    keys, values, queries = (chunk_tensors(g, geo, dtype, device, chunks) for _ in range(3))
    n = keys.shape[2]
    q, k, v = queries[-1], keys[-1], values[-1]
    rows = []

    # Anchor: a dense window, the current chunk copied into its tail, then attention over all of it.
    dense_k = torch.cat(list(keys), dim=1)
    dense_v = torch.cat(list(values), dim=1)
    resident = 2 * dense_k.numel() * dense_k.element_size() / 2**20
    anchor = float("nan")  # if the anchor fails, the other rows still run (their ratios are then NaN)
    for attention in dict.fromkeys([ANCHOR, *attentions]):  # the anchor first, and always
        def dense_step(attend=ATTENTION[attention]):
            dense_k[:, -n:].copy_(k)
            dense_v[:, -n:].copy_(v)
            return attend(q, dense_k, dense_v)

        try:
            ms = timed(dense_step, device, warmup, repeats)
            anchor = ms if attention == ANCHOR else anchor
            rows.append(Row(window, "dense", "dense window", attention, ms, ms / anchor,
                            step_peak_mib(dense_step, device), resident, 0.0))
        except Exception as error:
            rows.append(failed(window, "dense", "dense window", attention, error))
    del dense_k, dense_v

    rope = WanRotaryPosEmbed(geo["head_dim"], (1, 1, 1), max_seq_len=1024).to(device)
    latent = torch.zeros(1, 1, geo["chunk_frames"], geo["height"], geo["width"], device=device)
    for attention in attentions:
        for config_name in configs:
            for storage in storages:
                try:
                    rows.append(bench_cache(storage, config_name, attention, window, geo, (q, k, v), (keys, values),
                                            rope, latent, anchor, device, warmup, repeats))
                except Exception as error:  # one failing row must not cost the others
                    rows.append(failed(window, f"cache:{storage}", config_name, attention, error))
    return rows


def failed(window: int, variant: str, config: str, attention: str, error: Exception) -> Row:
    nan = float("nan")
    return Row(window, variant, config, attention, nan, nan, None, nan, nan, error=f"{type(error).__name__}: {error}")


def bench_cache(storage, config_name, attention, window, geo, current, history, rope, latent, anchor, device, warmup,
                repeats) -> Row:
    """One cached step: the window filled chunk by chunk (keys pre-RoPE, rotated on read), then the newest
    chunk's denoising rewrite timed."""
    q, k, v = current
    keys, values = history
    chunks, frames = len(keys), geo["chunk_frames"]
    config = CONFIGS[config_name]
    cache = dq.QVGCache(dq.CacheConfig(storage=storage, window_frames=window, **config), num_layers=1)
    layer = cache.layers[0]
    final = config["commit"] == "final-pass"  # the chunk being denoised is never stored: fill the ones before it
    with torch.no_grad():
        for c in range(chunks - 1 if final else chunks):
            with cache.chunk(start_frame=c * frames, final=final):
                cache.begin_forward(rope, latent, frames, geo["height"], geo["width"])
                layer.update(keys[c], keys[c], values[c])
    with cache.chunk(start_frame=(chunks - 1) * frames), torch.no_grad():
        cache.begin_forward(rope, latent, frames, geo["height"], geo["width"])

        def cache_step():
            window_k, window_v = layer.update(k, k, v)
            return ATTENTION[attention](q, window_k, window_v)

        ms = timed(cache_step, device, warmup, repeats)
        peak = step_peak_mib(cache_step, device)
    report = cache.memory_report()
    return Row(window, f"cache:{storage}", config_name, attention, ms, ms / anchor, peak, report.cache / 2**20,
               report.workspace / 2**20)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--small", action="store_true", help="tiny geometry for a CPU smoke run")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--storages", nargs="+", default=["bf16", "qvg-int2"])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="cache configurations (default: both)")
    parser.add_argument("--attention", nargs="+", choices=list(ATTENTION), default=["dispatch"],
                        help="the attention each row runs (default: dispatch); every row against dense + dispatch")
    parser.add_argument("--windows", nargs="+", type=int, help="latent frames per window (default: the geometry's)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)

    geo = SMALL if args.small else FULL
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for window in args.windows or geo["windows"]:
        rows += bench_window(window, args.storages, args.configs, args.attention, geo, dtype, device, args.warmup,
                             args.repeats)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# one layer's cached attention step, {name}, {dtype}, {geo['heads']} heads x {geo['head_dim']}, "
          f"{geo['chunk_frames'] * geo['height'] * geo['width']}-token chunks")
    print("| window (frames) | variant | cache configuration | attention | ms (median) | vs dense + dispatch "
          "| step peak MiB | cache MiB | workspace MiB (all layers) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.error is not None:
            print(f"| {r.window_frames} | {r.variant} | {r.config} | {r.attention} | failed: {r.error} | | | | |")
            continue
        peak = "n/a" if r.step_peak_mib is None else f"{r.step_peak_mib:.1f}"
        print(
            f"| {r.window_frames} | {r.variant} | {r.config} | {r.attention} | {r.ms:.3f} | {r.ratio:.2f}x | {peak} "
            f"| {r.resident_mib:.1f} | {r.workspace_mib:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return rows


if __name__ == "__main__":
    main()
