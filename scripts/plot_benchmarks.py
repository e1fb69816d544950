"""PNG plots of the benchmark JSON: cache memory against video length, attention error against bits/element.

    python scripts/bench_memory.py --json docs/bench_memory.json
    python scripts/bench_codec.py --json docs/bench_codec.json
    python scripts/plot_benchmarks.py --memory docs/bench_memory.json --codec docs/bench_codec.json --out docs

Reads only what those scripts wrote (their ``meta`` says how it was measured) and writes
``cache_memory.png`` and ``attention_error.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
from matplotlib.figure import Figure  # noqa: E402

COLORS = {"bf16": "tab:gray", "qvg-int2": "tab:blue", "qvg-int4": "tab:green", "nvfp4": "tab:red"}
STYLES = ["-", "--", ":", "-."]
DEFAULT_CODEC = "qvg-int2"


def memory_figure(report: dict) -> Figure:
    """GiB of the resident cache against latent frames, one line per storage and window setting."""
    rows, meta = report["rows"], report["meta"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    for storage in dict.fromkeys(r["storage"] for r in rows):
        for style, setting in zip(STYLES, settings):
            line = [r for r in rows if r["storage"] == storage and r["setting"] == setting]
            last = line[-1]  # the ratio goes in the legend: end labels of close lines (qvg-int4, nvfp4) overlap
            ax.plot([r["latent_frames"] for r in line], [r["cache_bytes"] / 2**30 for r in line], style,
                    color=COLORS.get(storage), label=f"{storage}, {setting}: {last['bf16_bytes'] / last['cache_bytes']:.2f}x")
    geo = meta["geometry"]
    ax.set(xlabel="video length (latent frames; 81 video frames = 21)", ylabel="resident KV cache (GiB, log scale)",
           yscale="log",
           title=f"KV cache, {geo['layers']} layers x {geo['heads']} heads x {geo['head_dim']}, "
                 f"{meta['tokens_per_frame']} tokens/frame, chunks of {geo['chunk_frames']} frames")
    ax.title.set_fontsize(9)
    ax.set_xlim(0, max(r["latent_frames"] for r in rows) * 1.1)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.text(0.01, 0.01, "exact bytes as the codecs allocate them (scripts/bench_memory.py); legend: vs BF16 "
             "of the same frames at the last length", fontsize=6, color="dimgray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return fig


def codec_figure(report: dict) -> Figure:
    """Attention error (flat and sharp queries) against bits/element, one point per codec row, named in the
    legend; lossless rows (error 0) cannot sit on the log axis and are named in the caption."""
    rows, meta = report["rows"], report["meta"]
    lossy = [r for r in rows if r["attention_error_pre_rope"] > 0]
    lossless = [r["codec"] for r in rows if r["attention_error_pre_rope"] == 0]
    colors = plt.get_cmap("tab20").colors + plt.get_cmap("tab20b").colors  # 40: one per row
    fig, axes = plt.subplots(1, 2, figsize=(12, 6.4), dpi=120, sharex=True)
    for ax, field, title in zip(axes, ("attention_error_pre_rope", "sharp_attention_error_pre_rope"),
                                ("attention error", f"sharp attention error (queries x {meta['sharpness']:g})")):
        for i, r in enumerate(lossy):
            baseline = not r["codec"].startswith(("qvg", "official"))
            default = r["codec"] == DEFAULT_CODEC  # drawn large and on top: variants share its bits
            ax.scatter(r["bits_per_element"], r[field], color=colors[i % len(colors)], label=r["codec"],
                       marker="*" if default else "s" if baseline else "o", s=120 if default else 30,
                       zorder=3 if default else 2, edgecolors="black", linewidths=0.3)
        ax.set(xlabel="bits per element (K and V)", yscale="log", title=title)
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("relL2 of softmax(QK^T)V, keys cached before RoPE")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", fontsize=7, ncol=4, bbox_to_anchor=(0.5, 0.03),
               title=f"codec (star: the default, {DEFAULT_CODEC}; squares: RTN, KIVI, LongLive-2, SGLang)", title_fontsize=7)
    caption = (f"{meta['chunks']} chunks of {meta['tokens_per_chunk']} video-derived tokens, {meta['heads']} heads x "
               f"{meta['head_dim']}; {meta['command']}; {meta['date'][:10]}")
    if lossless:
        caption += f"; error 0 (not drawn): {', '.join(lossless)}"
    fig.text(0.01, 0.01, caption, fontsize=6, color="dimgray")
    fig.tight_layout(rect=(0, 0.3, 1, 1))
    return fig


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--memory", type=Path, help="JSON of scripts/bench_memory.py")
    parser.add_argument("--codec", type=Path, help="JSON of scripts/bench_codec.py")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="folder for the PNGs (default docs)")
    args = parser.parse_args(argv)
    if args.memory is None and args.codec is None:
        parser.error("nothing to plot: pass --memory and/or --codec")

    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for source, figure, name in ((args.memory, memory_figure, "cache_memory.png"),
                                 (args.codec, codec_figure, "attention_error.png")):
        if source is None:
            continue
        fig = figure(json.loads(source.read_text()))
        fig.savefig(args.out / name, metadata={"Software": None})  # no version string: same data, same bytes
        plt.close(fig)
        written.append(args.out / name)
        print(f"wrote {args.out / name}")
    return written


if __name__ == "__main__":
    main()
