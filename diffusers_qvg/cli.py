"""``qvg-generate``: long videos from a causal Wan model with a QVG-compressed KV cache, on one or many GPUs.

With no ``--model`` it runs an embedded tiny causal Wan with seeded *random* weights on the CPU (a real MP4
of noise-like frames in seconds), to show the whole path without a download. Under ``accelerate launch``
(or ``torchrun``) the prompts of ``--prompts-file`` are split across processes, each with its own cache and
its own, rank-tagged output files; with ``--ulysses N`` every video runs on N processes (diffusers' Ulysses
context parallelism, each rank caching 1/N of the heads), M processes making M/N videos at a time.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from dataclasses import dataclass

import torch

TINY_NOTICE = (
    "No --model given: running the embedded tiny causal Wan (2 layers) with RANDOM weights on the CPU, so the "
    "video is noise, not your prompt.\nFor real videos pass a Self-Forcing/CausVid/LongLive checkpoint and the "
    "Wan2.1-T2V-1.3B base in diffusers layout:\n  qvg-generate \"a corgi surfing\" --model self_forcing_dmd.pt "
    "--base Wan2.1-T2V-1.3B-Diffusers --num-frames 81 --output corgi.mp4"
)


@dataclass
class VideoStats:
    """What one video cost: the numbers of the closing table."""

    name: str
    chunks: int
    kv_bytes: int
    bf16_bytes: int
    peak_gpu_bytes: int | None
    seconds_per_chunk: float


EXAMPLES = """examples:
  # the embedded tiny model with random weights, on the CPU, in seconds (the frames are noise)
  qvg-generate "a fox running through snow" --output fox.mp4

  # a real Self-Forcing checkpoint on the Wan2.1-T2V-1.3B base (diffusers layout), 81 frames
  qvg-generate --prompt "a corgi surfing a wave at sunset" --model checkpoints/self_forcing_dmd.pt \\
      --base Wan2.1-T2V-1.3B-Diffusers --num-frames 81 --kv-cache qvg-int2 --output corgi.mp4

  # a prompts file split across 8 GPUs, one video per line in videos/ (--ulysses 4: each video on 4 GPUs)
  accelerate launch --num_processes 8 -m diffusers_qvg.cli --prompts-file prompts.txt \\
      --model checkpoints/self_forcing_dmd.pt --base Wan2.1-T2V-1.3B-Diffusers --output videos/
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qvg-generate", description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("prompt", nargs="?", help="the text prompt (or --prompt, or --prompts-file)")
    parser.add_argument("--prompt", dest="prompt_option", metavar="PROMPT", help="the text prompt, as a flag")
    parser.add_argument("--prompts-file", help="one prompt per line; --output is then a directory")
    parser.add_argument("--model", help="a diffusers pipeline folder, or a causal Wan checkpoint (.pt/.safetensors)")
    parser.add_argument("--base", help="Wan base model folder (diffusers layout) for a --model checkpoint file")
    parser.add_argument("--num-frames", type=int, help="video frames: 9 + 12k (81 = 21 latent frames); "
                        "default 81, or 45 for the embedded model")
    parser.add_argument("--height", type=int, help="pixels, a multiple of 16 (default 480, or 160 for the embedded "
                        "model: QVG's 256 centroids need >= 256 tokens per chunk)")
    parser.add_argument("--width", type=int, help="pixels, a multiple of 16 (default 832, or 160 for the embedded model)")
    parser.add_argument("--kv-cache", default="qvg-int2", help="bf16, qvg-int2, qvg-int4, kivi-int2 or nvfp4 (LongLive-2's)")
    parser.add_argument("--window-frames", type=int, help="latent frames attended to (counting the sink)")
    parser.add_argument("--sink-frames", type=int, default=0, help="first latent frames never evicted")
    parser.add_argument("--keep-recent-chunks", type=int, default=0, help="finished chunks kept unquantized "
                        "(0: every chunk is packed at its clean-context pass, the smallest cache; 1: less error)")
    parser.add_argument("--guidance-scale", type=float, default=1.0, help="CFG scale (distilled models: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--output", help="MP4 file for one prompt, directory for --prompts-file "
                        "(default: video.mp4 / videos/)")
    parser.add_argument("--compile", nargs="?", const="default", choices=["default", "reduce-overhead", "max-autotune"],
                        help="torch.compile the transformer (fullgraph) with this mode: the first two chunks "
                        "compile (minutes for a 30-layer model on a GPU), later chunks and prompts reuse the graphs")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="weights dtype of a real model (the embedded one is float32)")
    parser.add_argument("--ulysses", type=int, default=1, metavar="N",
                        help="processes per video (under torchrun / accelerate launch): diffusers' Ulysses context "
                        "parallelism splits each chunk's tokens across N GPUs and each caches 1/N of the heads; "
                        "M processes make M/N videos at a time (N must divide M and the model's heads)")
    return parser


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None and args.prompt_option is not None:
        raise SystemExit(f"qvg-generate: the prompt is given twice ({args.prompt!r} and --prompt "
                         f"{args.prompt_option!r}); give it once, positionally or with --prompt")
    if args.prompt_option is not None:
        args.prompt = args.prompt_option
    if (args.prompt is None) == (args.prompts_file is None):
        raise SystemExit("qvg-generate: give a prompt (positionally or with --prompt) or --prompts-file (exactly one)")
    if args.prompt is not None:
        return [args.prompt]
    with open(args.prompts_file) as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise SystemExit(f"qvg-generate: {args.prompts_file} holds no prompts")
    return prompts


def load_pipeline(model: str | None, base: str | None, dtype: torch.dtype):
    """The pipeline for ``--model``: a pipeline folder, a checkpoint file (+ ``--base``), or the embedded one."""
    from diffusers_qvg.pipelines import QVGCausalWanPipeline, load_causal_wan_transformer, tiny_components

    if model is None:
        return QVGCausalWanPipeline(**tiny_components(seed=0))
    if os.path.isdir(model):
        return QVGCausalWanPipeline.from_pretrained(model, torch_dtype=dtype)
    if not os.path.isfile(model):
        raise SystemExit(f"qvg-generate: --model {model!r} is neither a folder nor a checkpoint file")
    if base is None:
        raise SystemExit("qvg-generate: a checkpoint --model needs --base, the Wan base model folder (diffusers "
                         "layout) that provides the config, the VAE and the text encoder")
    transformer = load_causal_wan_transformer(model, base, torch_dtype=dtype)
    return QVGCausalWanPipeline.from_pretrained(base, transformer=transformer, torch_dtype=dtype)


def output_paths(args: argparse.Namespace, indices: list[int], prompts: list[str], rank: int) -> list[str]:
    """One path per prompt; from a prompts file ``NNNN-rankR-slug.mp4`` (global index: no clobbering)."""
    if args.prompts_file is None:
        return [args.output or "video.mp4"]
    folder = args.output or "videos"
    os.makedirs(folder, exist_ok=True)
    slugs = [re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-")[:48] or "prompt" for p in prompts]
    return [os.path.join(folder, f"{i:04d}-rank{rank}-{slug}.mp4") for i, slug in zip(indices, slugs)]


def share(items: list, index: int, count: int) -> list:
    """Part ``index`` of ``items`` split into ``count`` contiguous parts, the first ones one longer
    (``PartialState.split_between_processes``'s split, for groups of processes)."""
    per, extra = divmod(len(items), count)
    start = index * per + min(index, extra)
    return items[start : start + per + (index < extra)]


def generate_one(pipe, prompt: str, path: str, args: argparse.Namespace, device: torch.device,
                 write: bool = True) -> VideoStats:
    """Stream one video chunk by chunk (timing each chunk), write it as MP4 (unless ``write`` is False: the
    other ranks of a Ulysses group, which skip decoding too), return its figures (KV bytes of this rank)."""
    from diffusers.utils import export_to_video
    import numpy as np

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    stream = pipe.stream(
        prompt, height=args.height, width=args.width, num_frames=args.num_frames, kv_cache=args.kv_cache,
        window_frames=args.window_frames, sink_frames=args.sink_frames,
        keep_recent_chunks=args.keep_recent_chunks, guidance_scale=args.guidance_scale,
        generator=torch.Generator().manual_seed(args.seed), output_type="np" if write else "latent",
    )
    chunks, seconds = [], []
    with stream:
        while not stream.done:
            start = time.perf_counter()
            chunks.append(stream.next_chunk())
            if cuda:
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        report = stream.cache.memory_report()
    if write:
        frames = np.concatenate(chunks, axis=1)[0]
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        export_to_video(list(frames), path, fps=args.fps)
    return VideoStats(
        name=os.path.basename(path),
        chunks=len(seconds),
        kv_bytes=report.cache,
        bf16_bytes=report.bf16_equivalent,
        peak_gpu_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        seconds_per_chunk=statistics.median(seconds),
    )


def format_table(rows: list[VideoStats], kv_cache: str, ranks: int = 1) -> str:
    """The closing table; with ``ranks`` > 1 (Ulysses) the byte columns are one rank's (1/ranks of the heads)."""
    mib = 2**20
    unit = "MiB" if ranks == 1 else "MiB/rank"
    header = f"{'video':<40} {'chunks':>6} {'KV ' + kv_cache + ' ' + unit:>16} {'BF16 ' + unit:>10} {'ratio':>6} " \
             f"{'peak GPU ' + unit:>12} {'s/chunk':>8}"
    lines = [header, "-" * len(header)]
    for r in rows:
        ratio = r.bf16_bytes / r.kv_bytes if r.kv_bytes else float("nan")
        peak = f"{r.peak_gpu_bytes / mib:.1f}" if r.peak_gpu_bytes is not None else "n/a (CPU)"
        lines.append(f"{r.name[:40]:<40} {r.chunks:>6} {r.kv_bytes / mib:>16.3f} {r.bf16_bytes / mib:>10.3f} "
                     f"{ratio:>6.2f} {peak:>12} {r.seconds_per_chunk:>8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from accelerate import PartialState

    from diffusers_qvg import VideoGroup, enable_ulysses

    args = build_parser().parse_args(argv)
    prompts = read_prompts(args)
    if args.ulysses > 1 and args.compile is not None:
        raise SystemExit("qvg-generate: --compile does not work with --ulysses yet: torch.compile(fullgraph=True) "
                         "cannot trace diffusers 0.42's context-parallel hooks; drop one of the two")
    embedded = args.model is None
    args.num_frames = args.num_frames or (45 if embedded else 81)
    args.height = args.height or (160 if embedded else 480)
    args.width = args.width or (160 if embedded else 832)

    cpu = embedded and (args.ulysses == 1 or not torch.cuda.is_available())  # embedded Ulysses: on the GPUs if any
    state = PartialState(cpu=cpu)
    device = torch.device("cpu") if cpu else state.device
    if embedded and state.is_main_process:
        print(TINY_NOTICE, flush=True)
    pipe = load_pipeline(args.model, args.base, getattr(torch, args.dtype)).to(device)
    pipe.set_progress_bar_config(disable=not state.is_local_main_process or state.num_processes > 1)
    if args.ulysses > 1:
        group = enable_ulysses(pipe.transformer, args.ulysses)
    else:
        group = VideoGroup(index=state.process_index, count=state.num_processes, rank=0, degree=1)
    if args.compile is not None:
        pipe.compile_transformer(mode=None if args.compile == "default" else args.compile)

    mine = share(list(enumerate(prompts)), group.index, group.count)
    indices = [i for i, _ in mine]
    mine_prompts = [p for _, p in mine]
    paths = output_paths(args, indices, mine_prompts, state.process_index)
    leader = group.rank == 0  # writes and prints its group's videos
    rows = [generate_one(pipe, p, path, args, device, write=leader) for p, path in zip(mine_prompts, paths)]
    if not leader:
        return
    ranked = group.count > 1  # tag lines only where several processes interleave them
    tag = f"[rank {state.process_index}] " if ranked else ""
    for path in paths:
        print(f"{tag}wrote {path}", flush=True)
    table = format_table(rows, args.kv_cache, group.degree)
    print(f"{tag.rstrip()}\n{table}" if ranked else table, flush=True)
    if embedded and state.is_main_process:
        print("(toy model, random weights: at 300 tokens per chunk QVG's centroid tables and the preallocated "
              "chunk slots dominate the bytes, so the ratio says little; scripts/bench_e2e.py measures the "
              "Wan2.1-1.3B geometry)")


if __name__ == "__main__":  # `python -m diffusers_qvg.cli`, and `accelerate launch -m diffusers_qvg.cli`
    main()
