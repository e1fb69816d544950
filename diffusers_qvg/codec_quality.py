"""Quality of a KV codec on a video-derived window, packed chunk by chunk as a streaming cache packs it.

Every chunk of the window (K after RoPE, K before RoPE, V) is packed on its own, as a cache packs each
finished chunk, and decoded back. Reported (see :class:`CodecQuality`): bits per element, relL2 of each tensor,
and the attention error of the newest chunk's queries over the whole window, where the older chunks are read
from the codec and the newest chunk (the one being denoised) stays exact, as in the cache (with
``keep_recent``, so do that many finished chunks before it).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .codecs import CodecConfig, Packed, Role, dequantize, quantize
from .metrics import attention, rel_l2
from .rotary import apply_wan_rotary
from .video_kv import VideoKV


@dataclass(frozen=True)
class CodecQuality:
    """One row of the codec benchmark.

    ``key_pre_rope_rel_l2`` and the ``*_pre_rope`` attention errors are for keys packed before RoPE and
    rotated after decoding (compared with the exact post-RoPE keys). ``sharp`` errors use queries scaled by
    ``sharpness``: peaked attention exposes key errors that flat attention averages away. Times are medians
    over the chunk-tensor calls after the first (warm), in milliseconds per chunk tensor.
    """

    bits_per_element: float
    key_rel_l2: float
    key_pre_rope_rel_l2: float
    value_rel_l2: float
    attention_error: float
    sharp_attention_error: float
    attention_error_pre_rope: float
    sharp_attention_error_pre_rope: float
    quantize_ms: float
    dequantize_ms: float


def _pack_chunks(
    codec: CodecConfig, x: torch.Tensor, data: VideoKV, role: Role, warm_start: bool, times: dict[str, list[float]]
) -> tuple[torch.Tensor, int]:
    """Pack and decode ``x`` one chunk at a time; returns the decoded window and the bytes it took."""
    out = torch.empty_like(x)
    nbytes, previous = 0, None
    for c in range(data.num_chunks):
        chunk = x[:, data.chunk(c)].contiguous()
        start = time.perf_counter()
        packed: Packed = quantize(chunk, codec, role=role, warm_start=previous if warm_start else None)
        middle = time.perf_counter()
        out[:, data.chunk(c)] = dequantize(packed)
        end = time.perf_counter()
        times["quantize"].append(middle - start)
        times["dequantize"].append(end - middle)
        nbytes += packed.nbytes
        previous = packed
    return out, nbytes


def _warm_median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples[1:] if len(samples) > 1 else samples)


def query_sample(data: VideoKV, queries: int) -> torch.Tensor:
    """``queries`` evenly spaced tokens of the window's last chunk (attention over 7 chunks is costly on CPU)."""
    last = data.chunk(data.num_chunks - 1)
    n = last.stop - last.start
    index = torch.linspace(last.start, last.stop - 1, min(queries, n)).round().long()
    return data.query[:, index]


@dataclass(frozen=True)
class AttentionProbe:
    """Queries of the newest chunk, ordinary and sharp, with their exact attention outputs (shared by all codecs)."""

    queries: dict[str, torch.Tensor]  # "ordinary" / "sharp" -> [1, q, heads, head_dim] float32
    references: dict[str, torch.Tensor]


def attention_probe(data: VideoKV, queries: int = 256, sharpness: float = 4.0) -> AttentionProbe:
    q = query_sample(data, queries).float()
    scaled = {"ordinary": q, "sharp": q * sharpness}
    key, value = data.key.float(), data.value.float()
    return AttentionProbe(scaled, {kind: attention(x, key, value) for kind, x in scaled.items()})


@dataclass(frozen=True)
class DecodedWindow:
    """The window as a cache holding ``codec`` decodes it: every chunk packed on its own and read back.

    ``key_pre_rope`` holds keys packed before RoPE and rotated after decoding, as the cache's read path does.
    """

    key: torch.Tensor
    key_pre_rope: torch.Tensor
    value: torch.Tensor
    key_bytes: int
    value_bytes: int
    times: dict[str, list[float]]  # "quantize" / "dequantize" -> seconds per chunk-tensor call


def decode_window(codec: CodecConfig, data: VideoKV, *, warm_start: bool = False) -> DecodedWindow:
    """Pack ``data``'s K (after and before RoPE) and V chunk by chunk with ``codec`` and decode them back.

    ``warm_start`` seeds each chunk's codec parameters from the previous chunk's (QVG's centroid caching).
    """
    times: dict[str, list[float]] = {"quantize": [], "dequantize": []}
    key_hat, key_bytes = _pack_chunks(codec, data.key, data, "key", warm_start, times)
    pre_hat, _ = _pack_chunks(codec, data.key_pre_rope, data, "key", warm_start, times)
    value_hat, value_bytes = _pack_chunks(codec, data.value, data, "value", warm_start, times)
    key_pre_rotated = apply_wan_rotary(pre_hat, data.cos, data.sin)
    return DecodedWindow(key_hat, key_pre_rotated, value_hat, key_bytes, value_bytes, times)


def cache_view(exact: torch.Tensor, decoded: torch.Tensor, exact_from: int) -> torch.Tensor:
    """The cache's view in float32: tokens before ``exact_from`` decoded, the rest (recent and current) exact."""
    view = decoded.to(torch.float32, copy=True)
    view[:, exact_from:] = exact[:, exact_from:].float()
    return view


def exact_from(data: VideoKV, keep_recent: int) -> int:
    """First token the cache holds exact: the current chunk's, or that of the ``keep_recent``-th chunk before it."""
    if not 0 <= keep_recent < data.num_chunks:
        raise ValueError(
            f"keep_recent={keep_recent} must lie in [0, {data.num_chunks - 1}] for {data.num_chunks} chunks"
        )
    return data.chunk(data.num_chunks - 1 - keep_recent).start


def measure_codec(
    codec: CodecConfig, data: VideoKV, probe: AttentionProbe, *, warm_start: bool = False, keep_recent: int = 0
) -> CodecQuality:
    """Pack ``data`` chunk by chunk with ``codec`` and measure it (see :class:`CodecQuality`).

    ``warm_start`` seeds each chunk's codec parameters from the previous chunk's (QVG's centroid caching).
    ``keep_recent`` finished chunks before the current one stay exact in the attention errors, as the cache's
    ``keep_recent_chunks`` keeps them unquantized.
    """
    start = exact_from(data, keep_recent)
    w = decode_window(codec, data, warm_start=warm_start)
    value_read = cache_view(data.value, w.value, start)
    errors = {
        (rope, kind): rel_l2(
            probe.references[kind], attention(probe.queries[kind], cache_view(data.key, keys, start), value_read)
        )
        for rope, keys in (("post", w.key), ("pre", w.key_pre_rope))
        for kind in ("ordinary", "sharp")
    }
    return CodecQuality(
        bits_per_element=8.0 * (w.key_bytes + w.value_bytes) / (data.key.numel() + data.value.numel()),
        key_rel_l2=rel_l2(data.key, w.key),
        key_pre_rope_rel_l2=rel_l2(data.key, w.key_pre_rope),
        value_rel_l2=rel_l2(data.value, w.value),
        attention_error=errors["post", "ordinary"],
        sharp_attention_error=errors["post", "sharp"],
        attention_error_pre_rope=errors["pre", "ordinary"],
        sharp_attention_error_pre_rope=errors["pre", "sharp"],
        quantize_ms=_warm_median_ms(w.times["quantize"]),
        dequantize_ms=_warm_median_ms(w.times["dequantize"]),
    )
