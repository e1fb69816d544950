"""End-to-end chunk latency and memory of the causal Wan pipeline: a plain BF16 KV cache vs ``"qvg-int2"``.

The Wan2.1-T2V-1.3B geometry (30 layers, 12 heads of 128, dim 1536, ffn 8960, 480x832: 1560 tokens per latent
frame) with seeded random weights (time and memory do not depend on them) and text embeddings of the right
shape ([1, 512, 4096]). For each video length (21 and 42 latent frames) and each setting, in one run: the
median seconds per chunk over a warm run, the cache's resident bytes against the BF16 bytes of the same
frames, and the peak GPU memory. The pipeline stores only each chunk's clean-context pass. On a GPU the last
chunk of each video runs under the PyTorch profiler instead (outside the median): its device time by kernel
family (the window read, the encoder, the rest) says where the overhead over the anchor goes.

The anchor is the plain BF16 cache a Self-Forcing user runs: rotated keys stored as they are, nothing rotated
on read, attended in place (``kv_cache="bf16", keys_before_rope=False``: ``CacheConfig.in_place``; the same
video as with keys stored before RoPE). Every
other row is reported as its seconds per chunk over the anchor's: the BF16 cache with keys stored before RoPE
(what the cache rotates on every read), and the compressed storages with the pipeline's default
``keep_recent_chunks`` (0: every chunk packed) and with 1 (one finished chunk stays BF16); the table says
which rows meet the KV-ratio target. A setting that fails is recorded with its error and the run goes on.
``--compile [MODE]`` then compiles the transformer (``pipe.compile_transformer``, fullgraph) and runs every
setting again after a compiling warm-up: compiled rows are compared with the compiled plain BF16 anchor, the
eager rows stay beside them for reference. ``--small`` runs the tiny model on the CPU (for tests, no figures).
``--ulysses N`` under ``torchrun`` runs every video on N ranks (diffusers' Ulysses context parallelism, each
rank caching 1/N of the heads); rank 0 prints its own bytes and peak memory, and the seconds per chunk of
its group.

    python scripts/bench_e2e.py                      # GPU, bf16 weights
    python scripts/bench_e2e.py --compile            # and compiled rows (torch.compile, inductor)
    python scripts/bench_e2e.py --small             # CPU smoke run
    torchrun --nproc-per-node 4 scripts/bench_e2e.py --ulysses 4   # one video on 4 GPUs
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from diffusers import AutoencoderKLWan, WanTransformer3DModel

from diffusers_qvg import device_times, enable_ulysses

from diffusers_qvg.pipelines import (
    QVGCausalWanPipeline,
    cast_keeping_fp32_modules,
    enable_upstream_numerics,
    randomize_,
    self_forcing_scheduler,
)
from diffusers_qvg.pipelines.random_models import (
    TINY_TRANSFORMER_CONFIG,
    TINY_VAE_CONFIG,
    WAN_1_3B_TRANSFORMER_CONFIG,
)

KV_RATIO_TARGET = 6.5
TARGETS = (f"targets: KV ratio >= {KV_RATIO_TARGET}x, latency overhead over the plain BF16 cache <= 3%, peak-memory drop >= 90% of the KV "
           "bytes saved")
PIPELINE_KEEP = inspect.signature(QVGCausalWanPipeline.stream).parameters["keep_recent_chunks"].default


def build_pipeline(small: bool, device: torch.device, dtype: torch.dtype) -> QVGCausalWanPipeline:
    """Random-weight transformer of the chosen geometry, built on ``device``; no text encoder (embeddings given)."""
    config = TINY_TRANSFORMER_CONFIG if small else WAN_1_3B_TRANSFORMER_CONFIG
    with torch.device(device):
        transformer = randomize_(WanTransformer3DModel(**config), seed=0)
    cast_keeping_fp32_modules(transformer, dtype)
    enable_upstream_numerics(transformer.eval())
    # Only the VAE's scale factors are used (latent output); it sits on ``device`` so that the pipeline's
    # execution device, taken from its first module, is the transformer's.
    vae = randomize_(AutoencoderKLWan(**TINY_VAE_CONFIG), seed=1).eval().to(device)
    pipe = QVGCausalWanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=self_forcing_scheduler(),
                                transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_video(pipe, setting: tuple[str, bool, int], latent_frames: int, args, text: torch.Tensor,
              device: torch.device, profile: bool = True) -> dict:
    """One video of ``setting`` = (storage, keys before RoPE, keep_recent_chunks); returns the median seconds per
    chunk (with ``profile`` the last one excepted: it runs under the profiler, for its device time by kernel
    family), the cache's bytes and the peak GPU memory."""
    storage, keys_before_rope, keep = setting
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    stream = pipe.stream(prompt_embeds=text, height=args.height, width=args.width,
                         num_frames=1 + 4 * (latent_frames - 1), kv_cache=storage, keep_recent_chunks=keep,
                         keys_before_rope=keys_before_rope, window_frames=args.window_frames, output_type="latent",
                         generator=torch.Generator().manual_seed(0))
    seconds, events, chunks = [], [], stream.num_chunks
    with stream:
        for i in range(chunks):
            if profile and i and i == chunks - 1:  # the last chunk (the fullest window) under the profiler, outside the median
                events = device_times.device_events(stream.next_chunk)
                break
            start = time.perf_counter()
            stream.next_chunk()
            if cuda:
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        report = stream.cache.memory_report()
    return dict(
        storage=storage,
        keys_before_rope=keys_before_rope,
        keep_recent_chunks=keep,
        compiled=pipe._keep_cache,
        ulysses=args.ulysses,
        latent_frames=latent_frames,
        chunks=chunks,
        seconds_per_chunk=statistics.median(seconds),
        last_chunk_device=device_times.by_family(events, device_times.qvg_families()) if events else None,
        kv_bytes=report.cache,
        total_bytes=report.total,
        bf16_bytes=report.bf16_equivalent,
        peak_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        error=None,
    )


def guarded_video(pipe, setting: tuple[str, bool, int], latent_frames: int, args, text, device,
                  profile: bool = True) -> dict:
    """:func:`run_video`, or the row of its failure (one failing setting must not cost the others)."""
    try:
        return run_video(pipe, setting, latent_frames, args, text, device, profile)
    except Exception as error:
        storage, keys_before_rope, keep = setting
        return dict(storage=storage, keys_before_rope=keys_before_rope, keep_recent_chunks=keep,
                    compiled=pipe._keep_cache, ulysses=args.ulysses, latent_frames=latent_frames,
                    error=f"{type(error).__name__}: {error}")


def is_anchor(row: dict) -> bool:
    return row["storage"] == "bf16" and not row["keys_before_rope"] and row["error"] is None


def compare(rows: list[dict]) -> list[str]:
    """Markdown rows against the plain BF16 run of the same length and compile state (measured in this run)."""
    anchors = {(r["latent_frames"], r["compiled"]): r for r in rows if is_anchor(r)}
    mib = 2**20
    lines = [f"| latent frames | compiled | storage | keys stored | recent chunks | s/chunk | vs plain BF16 | overhead | "
             f"KV MiB | KV ratio vs BF16 | >= {KV_RATIO_TARGET}x | peak MiB | peak drop / KV saved |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        keys = "before RoPE" if r["keys_before_rope"] else "rotated"
        compiled = "yes" if r["compiled"] else "no"
        head = f"| {r['latent_frames']} | {compiled} | {r['storage']} | {keys} | {r['keep_recent_chunks']} |"
        if r["error"] is not None:
            lines.append(f"{head} failed: {r['error']} |" + " |" * 7)
            continue
        anchor = anchors.get((r["latent_frames"], r["compiled"]))
        ratio_time = r["seconds_per_chunk"] / anchor["seconds_per_chunk"] if anchor else None
        vs, overhead = (f"{ratio_time:.3f}x", f"{ratio_time - 1:+.1%}") if anchor else ("n/a", "n/a")
        saved = anchor["kv_bytes"] - r["kv_bytes"] if anchor else 0
        drop = (f"{(anchor['peak_bytes'] - r['peak_bytes']) / saved:.0%}"
                if anchor and saved > 0 and r["peak_bytes"] is not None else "n/a")
        peak = f"{r['peak_bytes'] / mib:.0f}" if r["peak_bytes"] is not None else "n/a (CPU)"
        ratio = r["bf16_bytes"] / r["kv_bytes"]
        if r["storage"] == "bf16":
            meets = "anchor" if is_anchor(r) else "n/a"
        else:
            meets = "yes" if ratio >= KV_RATIO_TARGET else "no"
        lines.append(f"{head} {r['seconds_per_chunk']:.4f} | {vs} | {overhead} | {r['kv_bytes'] / mib:.1f} | "
                     f"{ratio:.2f}x | {meets} | {peak} | {drop} |")
    return lines


def device_lines(rows: list[dict]) -> list[str]:
    """Markdown rows: the last chunk's device time by kernel family (PyTorch profiler), and the total over the
    plain BF16 anchor's of the same length and compile state: where the overhead goes. Empty without CUDA."""
    rows = [r for r in rows if r["error"] is None and r["last_chunk_device"] is not None]
    if not rows:
        return []
    anchors = {(r["latent_frames"], r["compiled"]): r for r in rows if is_anchor(r)}
    families = list(rows[0]["last_chunk_device"])
    lines = ["| latent frames | compiled | storage | keys stored | recent chunks | "
             + " | ".join(f"{f} ms (launches)" for f in families) + " | total over the anchor's |",
             "|---|---|---|---|---|" + "---|" * (len(families) + 1)]
    for r in rows:
        device = r["last_chunk_device"]
        anchor = anchors.get((r["latent_frames"], r["compiled"]))
        over = (f"{device['total']['us'] - anchor['last_chunk_device']['total']['us']:+.0f} us" if anchor else "n/a")
        lines.append(f"| {r['latent_frames']} | {'yes' if r['compiled'] else 'no'} | {r['storage']} | "
                     f"{'before RoPE' if r['keys_before_rope'] else 'rotated'} | {r['keep_recent_chunks']} | "
                     + " | ".join(f"{device[f]['us'] / 1e3:.3f} ({device[f]['launches']})" for f in families)
                     + f" | {over} |")
    return lines


def settings_for(storages: list[str], keeps: list[int], rotated: list[str] = ()) -> list[tuple[str, bool, int]]:
    """(storage, keys before RoPE, keep_recent_chunks): "bf16" is the plain anchor (rotated keys) and the
    same cache with keys stored before RoPE; other storages store keys before RoPE, with each ``keep``, and
    those in ``rotated`` also after RoPE (as LongLive-2 stores its NVFP4 cache)."""
    settings = []
    for storage in storages:
        if storage == "bf16":
            settings += [("bf16", False, PIPELINE_KEEP), ("bf16", True, PIPELINE_KEEP)]
        else:
            settings += [(storage, before, keep) for before in (True, False)[: 1 + (storage in rotated)] for keep in keeps]
    return settings


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--small", action="store_true", help="tiny model on the CPU at 160x160")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--frames", type=int, nargs="+", default=None, help="latent frames (default 21 42)")
    parser.add_argument("--storages", nargs="+", default=["bf16", "qvg-int2"])
    parser.add_argument("--keep-recent-chunks", type=int, nargs="+", default=[PIPELINE_KEEP, 1],
                        help=f"settings for the compressed storages (default: the pipeline's {PIPELINE_KEEP}, and 1); "
                        "the bf16 rows run with the pipeline's")
    parser.add_argument("--rotated-keys", nargs="+", default=[], metavar="STORAGE",
                        help="storages also run with keys stored after RoPE (e.g. nvfp4, as LongLive-2 stores it)")
    parser.add_argument("--window-frames", type=int, default=None, help="sliding window (default: whole video)")
    parser.add_argument("--compile", nargs="?", const="default", default=None,
                        help="then compile the transformer with this torch.compile mode and run every setting again")
    parser.add_argument("--attention-backend", default=None, metavar="NAME",
                        help="diffusers attention backend for every row, the anchor's too (set_attention_backend; "
                        "e.g. _sage_qk_int8_pv_fp8_cuda_sm90, 8-bit attention: docs/benchmarks.md, design 3)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--ulysses", type=int, default=1, metavar="N",
                        help="ranks per video under torchrun (Ulysses context parallelism; bytes are per rank)")
    args = parser.parse_args(argv)
    args.frames = args.frames or ([9] if args.small else [21, 42])
    args.height, args.width = (160, 160) if args.small else (480, 832)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.small else "cpu"))
    if args.ulysses > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16

    pipe = build_pipeline(args.small, device, dtype)
    if args.attention_backend:  # before any row: a backend that cannot run fails here, naming its package
        pipe.transformer.set_attention_backend(args.attention_backend)
    if args.ulysses > 1:
        enable_ulysses(pipe.transformer, args.ulysses)
    text_dim = pipe.transformer.config.text_dim
    text = torch.randn(1, 512, text_dim, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    settings = settings_for(args.storages, args.keep_recent_chunks, args.rotated_keys)
    if not args.small:  # warm-up: kernels, allocator, k-means paths (a failure shows in its rows)
        for setting in settings:
            guarded_video(pipe, setting, 3 * 3, args, text, device, profile=False)
    rows = [guarded_video(pipe, setting, f, args, text, device) for f in args.frames for setting in settings]
    if args.compile is not None:
        # Each setting compiles its own graphs (its storage and key layout are traced constants): up to four
        # per setting, more than Dynamo's default limit of eight for the whole run.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(settings))
        compile_kwargs = {} if args.compile == "default" else {"mode": args.compile}
        if args.small:
            compile_kwargs["backend"] = "aot_eager"  # the CPU's inductor takes minutes: a smoke run of the path
        pipe.compile_transformer(**compile_kwargs)
        for setting in settings:  # warm-up that compiles: the window of the longest video, filling and full
            guarded_video(pipe, setting, max(args.frames), args, text, device, profile=False)
        rows += [guarded_video(pipe, setting, f, args, text, device) for f in args.frames for setting in settings]

    if args.ulysses > 1 and dist.get_rank() != 0:
        return rows
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    ranks = f", Ulysses over {args.ulysses} ranks (bytes and peak memory per rank)" if args.ulysses > 1 else ""
    print(f"bench_e2e on {name}, {'tiny' if args.small else 'Wan2.1-1.3B'} geometry, {args.height}x{args.width}, "
          f"{dtype}{ranks}, attention backend {args.attention_backend or 'default'}; {TARGETS}")
    print("\n".join(compare(rows)))
    device = device_lines(rows)
    print("\nThe last chunk's device time by kernel family (PyTorch profiler; that chunk is outside the medians):\n"
          + "\n".join(device) if device else "\n(no CUDA: no device times by kernel family)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(r, attention_backend=args.attention_backend) for r in rows], f, indent=2)
    return rows


if __name__ == "__main__":
    main()
