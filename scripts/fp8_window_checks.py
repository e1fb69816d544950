"""Issue 8's design 3 weighed on quality: the window read by 8-bit tensor-core attention.

FP8 attention (FlashAttention-3's FP8 forward) takes Q, K and V in e4m3 with one descale per (batch, head) and
rounds each softmax tile P to e4m3 before the P V product; scores, the running max, the row sums and the
output stay in float32. SageAttention2 (diffusers' ``_sage_qk_int8_pv_fp8_cuda_sm90`` backend) takes Q K in
int8 with fine scales and K smoothed, and P V in fp8. This script emulates such kernels tile by tile (online
softmax over key blocks of ``--block`` tokens, every rounding each one makes; products accumulated in float32)
on the codec benchmark's video-derived window, next to the same emulation in BF16 (Q, K, V and P in bfloat16,
as FlashAttention's BF16 forward rounds them) and the codec table's figure (float32 attention over the decoded
BF16 window). Two layouts: one kernel over the whole window, current chunk included; and the decoded history
in 8 bits beside the current chunk in BF16, two kernels merged by their log-sum-exp. The issue's gate: the
attention error within 1.1x of the BF16-window figure.

    python scripts/fp8_window_checks.py            # 7 chunks at Self-Forcing geometry, ~6 minutes on a CPU
    python scripts/fp8_window_checks.py --small    # tiny sizes, seconds (tests)
    TRITON_INTERPRET=1 python scripts/fp8_window_checks.py --codecs qvg-int2 --sageattention  # + its kernels
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

import torch

import diffusers_qvg as dq
from diffusers_qvg.codec_quality import attention_probe, cache_view, decode_window, exact_from
from diffusers_qvg.metrics import attention, rel_l2
from diffusers_qvg.sageattention_1 import sageattention_1
from diffusers_qvg.video_kv import VideoKVSpec, video_kv

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
SMALL = VideoKVSpec(height=64, width=96, patch=8, heads=2, head_dim=64)
SCALE_DIMS = {"head": (1, 3), "channel": (1,), "token": (3,)}  # dims one scale spans: per (batch, head[, ...])
SAGE_BLOCKS = (128, 64)  # SageAttention's per-block scales: query and key tokens per scale


def _scale(x: torch.Tensor, per: str | int, top: float) -> torch.Tensor:
    """Scales mapping amax to ``top``: per (batch, head) and ``per`` (see SCALE_DIMS), or block of ``per`` tokens."""
    if isinstance(per, int):
        b, n, h, _ = x.shape
        pad = torch.nn.functional.pad(x.abs(), (0, 0, 0, 0, 0, (-n) % per))
        amax = pad.unflatten(1, (-1, per)).amax(dim=(2, 4), keepdim=True)  # [B, blocks, 1, H, 1]
        amax = amax.expand(-1, -1, per, -1, -1).flatten(1, 2)[:, :n]
    else:
        amax = x.abs().amax(dim=SCALE_DIMS[per], keepdim=True)
    return amax.clamp_min(torch.finfo(torch.float32).tiny) / top


def to_e4m3(x: torch.Tensor, per: str | int = "head") -> torch.Tensor:
    """``x`` [B, tokens, heads, dim] rounded to e4m3; one scale per (batch, head[, channel | token]), amax -> 448."""
    scale = _scale(x, per, E4M3_MAX)
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def to_int8(x: torch.Tensor, per: str | int = "head") -> torch.Tensor:
    """``x`` rounded to symmetric int8 (amax -> 127, ties to even), scaled as :func:`to_e4m3`."""
    scale = _scale(x, per, 127.0)
    return torch.round(x / scale).clamp(-127, 127) * scale


@dataclass(frozen=True)
class Kernel:
    """What a flash-attention kernel's two products take: ``qk`` for Q and K, ``pv`` for P and V (None: float32;
    ``torch.int8``: symmetric int8 with float32 scales, as SageAttention's Q K product).

    ``smooth_k`` subtracts K's mean over the kernel's tokens before rounding (softmax-invariant: it shifts
    each query's scores by one constant, which the log-sum-exp gets back for merging); ``v_per_channel`` gives
    V one e4m3 scale per channel, which the kernel applies to the output's columns after the product. Both are
    SageAttention's. ``p_scale`` multiplies P before it is rounded (SageAttention2 scales P to use e4m3's
    range), so that small probabilities stay normal numbers. ``qk_scales`` is what one Q or K scale spans:
    ``"head"``, ``"token"`` (each query and key its own, applied to the scores as an outer product: one multiply
    per score) or ``"block"`` (SageAttention's: 128 queries, 64 keys).
    """

    qk: torch.dtype | None
    pv: torch.dtype | None
    smooth_k: bool = False
    v_per_channel: bool = False
    p_scale: float = 1.0
    qk_scales: str = "head"
    pv_accumulator: torch.dtype | None = None  # what each block's P V product is rounded to (None: float32)


FP8 = torch.float8_e4m3fn
KERNELS = {
    "bf16": Kernel(torch.bfloat16, torch.bfloat16),
    "fp8 (FlashAttention-3)": Kernel(FP8, FP8),
    "fp8 Q K, bf16 P V": Kernel(FP8, torch.bfloat16),
    "bf16 Q K, fp8 P V": Kernel(torch.bfloat16, FP8),
    "fp8, smoothed K, V per channel": Kernel(FP8, FP8, smooth_k=True, v_per_channel=True),
    "fp8, P x 256": Kernel(FP8, FP8, p_scale=256.0),
    "bf16 Q K, fp8 P V, P x 256": Kernel(torch.bfloat16, FP8, p_scale=256.0),
    "fp8, Q K per token, P x 256": Kernel(FP8, FP8, p_scale=256.0, qk_scales="token"),
    "int8 Q K, fp8 P V, P x 256": Kernel(torch.int8, FP8, p_scale=256.0),
    # SageAttention 1 (its Triton kernel): int8 Q K per block, smoothed K, fp16 P V summed per block in fp16.
    "SageAttention 1's recipe": Kernel(
        torch.int8, torch.float16, smooth_k=True, qk_scales="block", pv_accumulator=torch.float16
    ),
    # SageAttention2's sm90 kernel: int8 Q K (its per-thread scales lie between per-block and per-token ones),
    # smoothed K, fp8 P V with V per channel and P scaled by 448.
    "SageAttention2's recipe, Q K per block": Kernel(
        torch.int8, FP8, smooth_k=True, v_per_channel=True, p_scale=448.0, qk_scales="block"
    ),
    "SageAttention2's recipe, Q K per token": Kernel(
        torch.int8, FP8, smooth_k=True, v_per_channel=True, p_scale=448.0, qk_scales="token"
    ),
}


def rounded(x: torch.Tensor, dtype: torch.dtype | None, per: str | int = "head") -> torch.Tensor:
    """``x`` as the kernel's ``dtype`` holds it (None: float32, no rounding), back in float32."""
    if dtype is None:
        return x
    if dtype == torch.int8:
        return to_int8(x, per)
    return to_e4m3(x, per) if dtype == FP8 else x.to(dtype).float()


def tiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: Kernel, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One flash-attention kernel: (output, log-sum-exp), [B, heads, q, dim] / [B, heads, q].

    Q, K and V are rounded once; each key block's P, taken against the running max, is rounded before the
    P V product (e4m3 holds P in [0, 1] unscaled, as FlashAttention-3 does), while the row sums use P in
    float32.
    """
    k = k.float()
    shift = torch.zeros(q.shape[0], q.shape[2], q.shape[1])  # [B, heads, q]: what smoothing took off each score
    if kernel.smooth_k:
        mean = k.mean(dim=1, keepdim=True)
        k = k - mean
        shift = (q.float() * mean).sum(dim=-1).transpose(1, 2) / math.sqrt(q.shape[-1])
    q_per, k_per = SAGE_BLOCKS if kernel.qk_scales == "block" else (kernel.qk_scales, kernel.qk_scales)
    q, k = (rounded(t.float(), kernel.qk, per).transpose(1, 2) for t, per in ((q, q_per), (k, k_per)))
    v = rounded(v.float(), kernel.pv, "channel" if kernel.v_per_channel else "head").transpose(1, 2)
    q = q / math.sqrt(q.shape[-1])
    m = torch.full(q.shape[:-1], -math.inf)
    l = torch.zeros(q.shape[:-1])
    acc = torch.zeros(q.shape)
    for j in range(0, k.shape[2], block):
        s = q @ k[:, :, j : j + block].transpose(-1, -2)
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l = l * alpha + p.sum(dim=-1)
        p_mma = p if kernel.pv is None else (p * kernel.p_scale).to(kernel.pv).float() / kernel.p_scale
        pv = p_mma @ v[:, :, j : j + block]
        acc = acc * alpha[..., None] + (pv if kernel.pv_accumulator is None else pv.to(kernel.pv_accumulator).float())
        m = m_new
    return acc / l[..., None], m + torch.log(l) + shift  # the shift is added back in float32 for the merge


def merged(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Outputs of kernels over disjoint key sets, merged by their log-sum-exp; [B, q, heads, dim]."""
    lse = torch.logsumexp(torch.stack([s for _, s in parts]), dim=0)
    return sum(o * torch.exp(s - lse)[..., None] for o, s in parts).transpose(1, 2)


def layouts(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: Kernel, split: int, block: int
) -> dict[str, torch.Tensor]:
    """The window ``k``/``v`` (current chunk from ``split``) read by one ``kernel``, or its history by ``kernel``
    and the current chunk by a BF16 kernel, merged."""
    history = tiled_attention(q, k[:, :split], v[:, :split], kernel, block)
    current = tiled_attention(q, k[:, split:], v[:, split:], KERNELS["bf16"], block)
    whole = tiled_attention(q, k, v, kernel, block)
    return {"one kernel": merged([whole]), "history + bf16 current": merged([history, current])}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 1e-6 else "-"  # an exact window has no error to compare with


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--small", action="store_true", help="tiny sizes (64x96 frames, 2 chunks, 2 heads x 64)")
    parser.add_argument("--chunks", type=int, default=7, help="chunks in the window (7 = 21 latent frames)")
    parser.add_argument("--queries", type=int, default=256, help="queries sampled from the last chunk")
    parser.add_argument("--block", type=int, default=128, help="key tokens per tile of the emulated kernels")
    parser.add_argument("--codecs", nargs="+", default=["bf16", "qvg-int2"], help="cache storages to read")
    parser.add_argument("--sageattention", action="store_true",
                        help="also SageAttention 1.0.6's own Triton kernels, one kernel over the window (on a CPU "
                        "with TRITON_INTERPRET=1, through Triton's interpreter: ~1.5 min per row at full size)")
    args = parser.parse_args(argv)
    if args.sageattention and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--sageattention runs its Triton kernels on CUDA, or on a CPU through Triton's interpreter: "
                     "run the script with TRITON_INTERPRET=1")
    torch.set_num_threads(1)
    spec, chunks, queries = (SMALL, 2, 64) if args.small else (VideoKVSpec(), args.chunks, args.queries)
    data = video_kv(spec, chunks=chunks)
    probe = attention_probe(data, queries, 4.0)
    split = exact_from(data, 0)
    print(f"{spec.tokens_per_chunk} tokens/chunk x {chunks} chunks, {spec.heads} heads x {spec.head_dim}, "
          f"{queries} queries of the last chunk, key blocks of {args.block}; torch {torch.__version__}\n"
          "attention error (and its ratio to the table's: float32 attention over the decoded window)\n")
    columns = list(KERNELS) + (["sageattention 1.0.6 itself"] if args.sageattention else [])
    print("| storage | keys stored | queries | layout | table | " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|" + "---|" * len(columns))
    for name in args.codecs:
        w = decode_window(dq.resolve_codec(name), data)
        value = cache_view(data.value, w.value, split)
        keys = (("after RoPE", w.key),) if name == "bf16" else (("after RoPE", w.key), ("before RoPE", w.key_pre_rope))
        for rope, decoded in keys:
            key = cache_view(data.key, decoded, split)
            for kind, q in probe.queries.items():
                ref = probe.references[kind]
                table = rel_l2(ref, attention(q, key, value))  # the codec table's own figure
                cells: dict[str, list[str]] = {"one kernel": [], "history + bf16 current": []}
                for kernel in KERNELS.values():
                    for layout, out in layouts(q, key, value, kernel, split, args.block).items():
                        e = rel_l2(ref, out)
                        cells[layout].append(f"{e:.4f} ({ratio(e, table)})")
                if args.sageattention:  # it returns no log-sum-exp: no merged layout
                    e = rel_l2(ref, sageattention_1(q, key, value).float())
                    cells["one kernel"].append(f"{e:.4f} ({ratio(e, table)})")
                    cells["history + bf16 current"].append("-")
                for layout, row in cells.items():
                    cells_text = " | ".join(row)
                    print(f"| {name} | {rope} | {kind} | {layout} | {table:.4f} | {cells_text} |", flush=True)


if __name__ == "__main__":
    main()
