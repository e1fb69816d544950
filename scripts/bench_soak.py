"""Soak: a tiny-model stream of 10x its window with a sink; per chunk the cache's memory_report(), the process's
peak RSS, the chunk's seconds, and whether any cache storage moved (all flat once the window is full).

The tiny causal Wan (``pipelines/random_models.py``, seeded random weights: memory and time do not depend on
them) with a RoPE table shorter than the stream, so positions are re-based past it, and a prompt switch with a
KV re-cache every few chunks: what an endless interactive stream does. Frames are decoded (``np``) and
dropped, as a viewer would. CPU; the figures go into docs/benchmarks.md.

glibc's malloc raises its mmap threshold as large buffers are freed, after which freed buffers may stay
resident or not from one chunk to the next (RSS swings of ~100 MB at 160x160 with a constant set of live
tensors); a fixed threshold makes RSS follow the live buffers, so the figures are taken with one:

    MALLOC_MMAP_THRESHOLD_=131072 python scripts/bench_soak.py --json docs/bench_soak.json
    python scripts/bench_soak.py --small             # CPU smoke run (tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import time

import diffusers
import torch
from diffusers import WanTransformer3DModel

import diffusers_qvg as dq
from diffusers_qvg.pipelines import QVGCausalWanPipeline, randomize_, tiny_components
from diffusers_qvg.pipelines.random_models import TINY_TRANSFORMER_CONFIG

PROMPTS = ("a red fox running through snow", "a blue whale under the sea", "a green owl in a dark forest")


def build_pipeline(rope_max_seq_len: int) -> QVGCausalWanPipeline:
    """The tiny pipeline, its transformer's RoPE table ``rope_max_seq_len`` frames long."""
    components = tiny_components(seed=0)
    config = TINY_TRANSFORMER_CONFIG | {"rope_max_seq_len": rope_max_seq_len}
    components["transformer"] = randomize_(WanTransformer3DModel(**config), seed=2).eval()
    pipe = QVGCausalWanPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def storage_pointers(cache: dq.QVGCache) -> list[int]:
    """Where every storage tensor of the cache and its workspace live."""
    tensors = [t for layer in cache.layers for s in layer.storages() for t in s.tensors().values()]
    return [t.data_ptr() for t in tensors] + [cache.workspace.keys.data_ptr()]


def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process."""
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss: KiB on Linux


def soak(pipe, storage, *, window_frames: int, sink_frames: int, windows: int, height: int, width: int,
         switch_every: int) -> list[dict]:
    """One stream of ``windows * window_frames`` latent frames; a row per chunk."""
    latent_frames = windows * window_frames
    rows, pointers = [], None
    with pipe.stream(prompt=PROMPTS[0], height=height, width=width, num_frames=1 + 4 * (latent_frames - 1),
                     kv_cache=storage, window_frames=window_frames, sink_frames=sink_frames, output_type="np",
                     generator=torch.Generator().manual_seed(0)) as state:
        while not state.done:
            chunk = state.chunk_index
            switch = bool(switch_every) and chunk > 0 and chunk % switch_every == 0
            if switch:
                state.set_prompt(prompt=PROMPTS[(chunk // switch_every) % len(PROMPTS)])
            start, cpu = time.perf_counter(), time.process_time()
            state.next_chunk()
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
            now = storage_pointers(state.cache)
            current, peak = rss_bytes()
            rows.append(dict(
                chunk=chunk, start_frame=chunk * 3, switch=switch, seconds=seconds, cpu_seconds=cpu_seconds,
                rss_bytes=current,
                peak_rss_bytes=peak, storage_moved=pointers is not None and now != pointers,
                clean_latent_bytes=sum(x.nbytes for x in state.clean_latents.values()),
                memory=dataclasses.asdict(state.cache.memory_report()),
            ))
            pointers = now
    return rows


def summary(rows: list[dict]) -> dict:
    """Where the memory report stops changing, and what grows after that point (nothing should)."""
    full = next(c for c in range(len(rows)) if all(r["memory"] == rows[c]["memory"] for r in rows[c:]))
    after = rows[full:]
    half = len(after) // 2

    def median(key, part, switch=False):
        return statistics.median([r[key] for r in part if r["switch"] == switch] or [float("nan")])

    # least-squares slope of the resident set over the chunks (the allocator's ups and downs average out)
    rss_slope = statistics.linear_regression([r["chunk"] for r in after], [r["rss_bytes"] for r in after]).slope

    return dict(
        chunks=len(rows),
        memory_flat_from_chunk=full,
        cache_bytes=rows[-1]["memory"]["sink"] + rows[-1]["memory"]["packed"] + rows[-1]["memory"]["recent"],
        workspace_bytes=rows[-1]["memory"]["workspace"],
        storage_moves_after_flat=sum(r["storage_moved"] for r in after[1:]),
        clean_latent_bytes=sorted({r["clean_latent_bytes"] for r in after}),
        rss_after_flat=[min(r["rss_bytes"] for r in after), max(r["rss_bytes"] for r in after)],
        rss_slope_bytes_per_chunk=rss_slope,
        peak_rss_at_flat=after[0]["peak_rss_bytes"],
        peak_rss_at_end=rows[-1]["peak_rss_bytes"],
        **{f"{key}_{name}": median(key, part) for key in ("seconds", "cpu_seconds")
           for name, part in (("first_half", after[:half]), ("second_half", after[half:]))},
        cpu_seconds_with_switch=median("cpu_seconds", after, switch=True),
    )


def table(runs: list[dict]) -> list[str]:
    mib = 2**20
    lines = ["| storage | latent frames (window, sink) | chunks | memory report flat from chunk | cache KiB | "
             "storage moves after | RSS MiB after (min-max) | RSS trend KiB/chunk | peak RSS MiB at flat -> end | "
             "CPU s/chunk 1st -> 2nd half | wall s/chunk 1st -> 2nd half | CPU s/chunk with a switch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s, o = run["summary"], run["settings"]
        low, high = (b / mib for b in s["rss_after_flat"])
        lines.append(
            f"| {o['storage']} | {o['latent_frames']} ({o['window_frames']}, {o['sink_frames']}) | {s['chunks']} | "
            f"{s['memory_flat_from_chunk']} | {s['cache_bytes'] / 1024:.1f} | {s['storage_moves_after_flat']} | "
            f"{low:.0f}-{high:.0f} | {s['rss_slope_bytes_per_chunk'] / 1024:+.0f} | "
            f"{s['peak_rss_at_flat'] / mib:.0f} -> {s['peak_rss_at_end'] / mib:.0f} | "
            f"{s['cpu_seconds_first_half']:.2f} -> {s['cpu_seconds_second_half']:.2f} | "
            f"{s['seconds_first_half']:.2f} -> {s['seconds_second_half']:.2f} | {s['cpu_seconds_with_switch']:.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--small", action="store_true", help="32x32, 3 windows, a few-centroid QVG (tests)")
    parser.add_argument("--storages", nargs="+", default=["qvg-int2", "bf16"])
    parser.add_argument("--window-frames", type=int, default=12, help="LongLive's window (12 latent frames)")
    parser.add_argument("--sink-frames", type=int, default=3)
    parser.add_argument("--windows", type=int, default=10, help="stream length in windows")
    parser.add_argument("--rope-max-seq-len", type=int, default=48, help="RoPE table of the tiny transformer")
    parser.add_argument("--switch-every", type=int, default=8, help="chunks between prompt switches (0: none)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one: steady times on a shared CPU)")
    parser.add_argument("--json", help="also write the runs to this JSON file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.small:
        # 12 tokens per chunk at 32x32: QVG's 256 centroids need 256, so the small run packs with 8
        storages = [("qvg-int2 (8 centroids)", dq.QVGConfig(num_centroids=8))]
        args.windows, args.rope_max_seq_len, args.switch_every, size = 3, 16, 4, 32
    else:
        storages, size = [(name, name) for name in args.storages], 160  # 300 tokens per chunk
    pipe = build_pipeline(args.rope_max_seq_len)
    runs = []
    for name, storage in storages:
        settings = dict(storage=name, latent_frames=args.windows * args.window_frames, window_frames=args.window_frames,
                        sink_frames=args.sink_frames, rope_max_seq_len=args.rope_max_seq_len,
                        switch_every=args.switch_every, height=size, width=size, threads=args.threads)
        rows = soak(pipe, storage, window_frames=args.window_frames, sink_frames=args.sink_frames,
                    windows=args.windows, height=size, width=size, switch_every=args.switch_every)
        runs.append(dict(settings=settings, summary=summary(rows), rows=rows))
    print(f"bench_soak on CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
          f"diffusers {diffusers.__version__}, {size}x{size}, RoPE table {args.rope_max_seq_len} frames")
    print("\n".join(table(runs)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=platform.platform(), torch=torch.__version__, diffusers=diffusers.__version__,
                           malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"), runs=runs), f, indent=2)
    return runs


if __name__ == "__main__":
    main()
