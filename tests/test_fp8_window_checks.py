"""The FP8-window emulation of scripts/fp8_window_checks.py (issue 8, design 3): its kernels are flash attention."""

import math

import pytest
import torch

from diffusers_qvg.metrics import attention
from diffusers_qvg.sageattention_1 import sageattention_1
from script_modules import load_script

fp8 = load_script("fp8_window_checks")
EXACT = fp8.Kernel(None, None)


def _qkv(tokens: int = 300, queries: int = 17, heads: int = 3, dim: int = 16, sharpness: float = 2.0):
    g = torch.Generator().manual_seed(0)
    sizes = ((queries, sharpness), (tokens, 1.0), (tokens, 1.0))
    q, k, v = (torch.randn(1, n, heads, dim, generator=g) * scale for n, scale in sizes)
    return q, k + 3.0 * torch.randn(1, 1, heads, dim, generator=g), v  # a common key offset, as smoothing removes


@pytest.mark.parametrize("block", [7, 128, 300, 1000])
def test_unrounded_kernel_is_attention_for_any_block(block):
    q, k, v = _qkv()
    out, lse = fp8.tiled_attention(q, k, v, EXACT, block)
    torch.testing.assert_close(out.transpose(1, 2), attention(q, k, v), rtol=1e-5, atol=1e-6)
    scores = q.transpose(1, 2) @ k.permute(0, 2, 3, 1) / math.sqrt(q.shape[-1])
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("smooth_k", [False, True])
def test_kernels_over_split_keys_merge_to_the_whole(smooth_k):
    """Smoothing shifts each kernel's scores by its own constant: the merge must get it back."""
    q, k, v = _qkv()
    kernel = fp8.Kernel(None, None, smooth_k=smooth_k)
    parts = [fp8.tiled_attention(q, k[:, a:b], v[:, a:b], kernel, 64) for a, b in ((0, 111), (111, 300))]
    torch.testing.assert_close(fp8.merged(parts), attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_e4m3_scales_per_head_channel_or_token():
    x = torch.zeros(1, 4, 2, 3)
    x[0, :, 0] = torch.tensor([[1.0, 0.5, -2.0], [0.25, 1.5, 0.0], [3.0, -1.0, 0.75], [0.5, 0.5, 0.5]])
    x[0, :, 1] = 1e-3 * x[0, :, 0]
    per_head = fp8.to_e4m3(x)
    assert per_head.abs().amax(dim=(1, 3))[0].tolist() == pytest.approx([3.0, 3e-3], rel=1e-6)
    torch.testing.assert_close(per_head[0, :, 1], 1e-3 * per_head[0, :, 0], rtol=1e-6, atol=0)  # scale-free
    for per, dims in (("channel", 1), ("token", 3)):
        rounded = fp8.to_e4m3(x, per)
        torch.testing.assert_close(rounded.abs().amax(dim=dims), x.abs().amax(dim=dims), rtol=1e-6, atol=0)
    y = torch.randn(1, 64, 2, 32, generator=torch.Generator().manual_seed(1))
    err = (fp8.to_e4m3(y) - y).abs() / y.abs().amax(dim=(1, 3), keepdim=True)
    assert 0 < err.max() <= 16 / 448  # amax -> 448 in [256, 512), whose ulp is 32: half of it at most


def test_block_scales_span_their_tokens_and_a_short_last_block():
    x = torch.randn(1, 150, 2, 8, generator=torch.Generator().manual_seed(3))
    rounded = fp8.to_int8(x, 64)
    for a, b in ((0, 64), (64, 128), (128, 150)):
        step = x[:, a:b].abs().amax(dim=(1, 3), keepdim=True) / 127
        levels = rounded[:, a:b] / step
        torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-4)
        assert levels.abs().amax(dim=(1, 3)).flatten().tolist() == pytest.approx([127, 127], abs=1e-4)


def test_int8_maps_amax_to_127_and_rounds_to_the_nearest_step():
    y = torch.randn(1, 64, 2, 32, generator=torch.Generator().manual_seed(2))
    step = y.abs().amax(dim=3, keepdim=True) / 127
    rounded = fp8.to_int8(y, "token")
    levels = rounded / step
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-4)
    assert levels.abs().amax().item() == pytest.approx(127, abs=1e-4)
    assert ((rounded - y).abs() <= step / 2 * (1 + 1e-5)).all()


def test_fp8_rounding_is_what_adds_error():
    q, k, v = _qkv(tokens=512, queries=32, dim=64, sharpness=0.5)
    ref = attention(q, k, v)
    errors = {name: (fp8.merged([fp8.tiled_attention(q, k, v, kern, 128)]) - ref).norm() / ref.norm()
              for name, kern in fp8.KERNELS.items()}
    assert 4 * errors["bf16"] < errors["fp8 (FlashAttention-3)"] < 0.1
    assert errors["fp8 Q K, bf16 P V"] < errors["fp8 (FlashAttention-3)"]


def test_the_sageattention_1_emulation_matches_its_own_kernels():
    """The emulation of SageAttention 1's recipe against sageattention 1.0.6's Triton kernels (interpreted here)."""
    # Whole blocks: its kernel counts the zeros it loads past the last key into the softmax's sums.
    q, k, v = _qkv(tokens=768, queries=128, heads=2, dim=64, sharpness=1.0)
    q, k, v = (t.to(torch.bfloat16).float() for t in (q, k, v))  # what the kernels get
    ref = attention(q, k, v)
    real = sageattention_1(q, k, v).float()
    emulated = fp8.merged([fp8.tiled_attention(q, k, v, fp8.KERNELS["SageAttention 1's recipe"], 64)])
    error = {name: ((out - ref).norm() / ref.norm()).item() for name, out in (("real", real), ("emulated", emulated))}
    assert 1e-3 < error["real"] < 0.05 and error["emulated"] == pytest.approx(error["real"], rel=0.1)


def test_small_run_prints_every_kernel(capsys):
    fp8.main(["--small", "--codecs", "qvg-int2"])
    out = capsys.readouterr().out
    assert all(name in out for name in fp8.KERNELS)
    rows = [line for line in out.splitlines() if line.startswith("| qvg-int2")]
    assert len(rows) == 8  # 2 key placements x 2 query kinds x 2 layouts


def test_small_run_with_sageattention_s_own_kernels(capsys):
    fp8.main(["--small", "--codecs", "qvg-int2", "--sageattention"])  # the tests run Triton interpreted
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| qvg-int2")]
    assert len(rows) == 8 and all(line.endswith(" | - |") for line in rows if "history" in line)
