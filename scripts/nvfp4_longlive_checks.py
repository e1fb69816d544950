"""Two differences from LongLive-2's NVFP4 cache, measured on the codec benchmark's data (docs/benchmarks.md,
"Against LongLive-2's NVFP4 cache"): its second-level scale over all heads of a chunk (ours: per head), and its
key smoothing (``k - k.mean(dim=-1)`` cached, ``utils/quant.py: k_smooth``; the preset leaves it out).

    python scripts/nvfp4_longlive_checks.py      # about 2 minutes on a CPU
"""

from __future__ import annotations

import torch

import diffusers_qvg as dq
from diffusers_qvg.codec_quality import attention_probe
from diffusers_qvg.codecs.nvfp4.codec import encode_blocks_reference, second_level_scale
from diffusers_qvg.codecs.nvfp4.format import SCALE_RULES, e2m1_values
from diffusers_qvg.metrics import attention, rel_l2
from diffusers_qvg.video_kv import VideoKVSpec, video_kv


def decoded(x: torch.Tensor, rule: str, per_chunk: bool) -> torch.Tensor:
    """``x`` (one chunk) through NVFP4 and back, the second level per head or over the chunk's heads."""
    g = second_level_scale(x, SCALE_RULES[rule][0])
    if per_chunk:
        g = second_level_scale(x.flatten(2).unsqueeze(2), SCALE_RULES[rule][0]).expand_as(g)  # one amax for all heads
    packed, scales = encode_blocks_reference(x, g, rule)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    blocks = e2m1_values(codes, torch.float32).unflatten(-1, (-1, 16))
    return (blocks * (scales.float() * g[:, None, :, None])[..., None]).flatten(-2)


def main() -> None:
    torch.set_num_threads(1)
    data = video_kv(VideoKVSpec(), chunks=7)

    def window(x: torch.Tensor, rule: str, per_chunk: bool) -> torch.Tensor:
        return torch.cat([decoded(x[:, data.chunk(c)].float(), rule, per_chunk) for c in range(data.num_chunks)], dim=1)

    print("second-level scale: relL2, per head (ours) / per chunk (LongLive-2)")
    for rule in SCALE_RULES:
        for name, x in (("K", data.key), ("K pre-RoPE", data.key_pre_rope), ("V", data.value)):
            ours, theirs = (rel_l2(window(x, rule, c), x.float()) for c in (False, True))
            print(f"  {rule:13s} {name:10s} {ours:.5f} / {theirs:.5f}")

    probe = attention_probe(data, 256, 4.0)
    last = data.chunk(data.num_chunks - 1).start
    key, value = data.key.float(), data.value.float()
    smooth = key - key.mean(dim=-1, keepdim=True)

    def cache(x: torch.Tensor) -> torch.Tensor:  # older chunks through the codec, the current one exact
        out = window(x.to(torch.bfloat16), "four-over-six", False)
        out[:, last:] = x[:, last:]
        return out

    print(f"key smoothing (K's channel mean is {float(key.mean(-1).square().mean().sqrt() / key.square().mean().sqrt()):.3f} "
          "of its RMS): attention error, sharp attention error")
    v_hat = cache(value)
    for name, keys, values in (("smoothing alone", smooth, value), ("nvfp4", cache(key), v_hat),
                               ("nvfp4 + smoothing", cache(smooth), v_hat)):
        errors = [rel_l2(probe.references[k], attention(probe.queries[k], keys, values)) for k in ("ordinary", "sharp")]
        print(f"  {name:18s} {errors[0]:.4f} {errors[1]:.4f}")


if __name__ == "__main__":
    main()
