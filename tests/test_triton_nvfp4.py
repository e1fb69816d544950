"""The Triton NVFP4 window decoder against the reference decoder: bit-identical for every byte pattern, workspace
dtype, RoPE form and segment layout; one launch for a layer's keys and values."""

import pytest
import torch

import diffusers_qvg as dq
from diffusers_qvg.codecs.kernel_backend import backend
from diffusers_qvg.codecs.nvfp4 import NVFP4Packed
from diffusers_qvg.codecs.nvfp4.format import decode_reference
from diffusers_qvg.codecs.nvfp4.triton_decode import dequantize_into, dequantize_pair_into
from diffusers_qvg.rotary import rotary_pairs
from launch_counts import counting_launches, launch_arguments
from segment_rows import gapped_rows, uncovered

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled kernels on GPU, interpreted on CPU
SEGMENTS = dq.segment_table([(6, 7, 1, 2), (0, 5, 8, 1), (5, 1, 0, 0)])  # out of order, a one-token segment


def random_storage(*, batch=2, tokens=13, heads=3, head_dim=64, slots=3, dtype=torch.bfloat16, seed=0) -> NVFP4Packed:
    """Storage of arbitrary bytes: every code pair, every e4m3 scale but NaN, tensor scales of any magnitude."""
    g = torch.Generator().manual_seed(seed)
    s = dq.NVFP4Config().allocate(batch=batch, capacity_tokens=tokens, heads=heads, head_dim=head_dim,
                                  num_slots=slots, dtype=dtype, device="cpu")
    s.codes.copy_(torch.randint(0, 256, s.codes.shape, generator=g, dtype=torch.uint8))
    s.scales.view(torch.uint8).copy_(torch.randint(0, 127, s.scales.shape, generator=g, dtype=torch.uint8))
    s.tensor_scale.copy_(torch.rand(s.tensor_scale.shape, generator=g) * 2.0 ** torch.randint(-30, 10, s.tensor_scale.shape, generator=g))
    return NVFP4Packed(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in s.__dict__.items()})


def random_rotary(window, head_dim, seed=1):
    g = torch.Generator().manual_seed(seed)
    angles = torch.randn(1, window, 1, head_dim // 2, generator=g, dtype=torch.float64) * 40
    return tuple(f(angles).repeat_interleave(2, dim=-1).float().to(DEVICE) for f in (torch.cos, torch.sin))


def bits(t):
    return t.contiguous().view(torch.uint8)


def assert_bit_identical(storage, segments, window, rotary=None, out=None):
    B, _, H, D = storage.shape
    if out is None:
        out = torch.full((B, window, H, D), 7.0, dtype=storage.dtype, device=DEVICE)
    segments = segments.to(DEVICE)
    expected = out.clone()
    decode_reference(storage, segments, expected, rotary)
    dequantize_into(storage, segments, out, rotary)
    assert torch.equal(bits(out), bits(expected))
    return out


def test_every_code_and_scale_pattern_decodes_bit_identically():
    storage = random_storage(tokens=64, heads=1, slots=1)
    storage.codes[0, :, 0].view(-1)[:256] = torch.arange(256, dtype=torch.uint8, device=DEVICE)  # every code pair
    storage.scales[0, :, 0].view(torch.uint8).view(-1)[:127] = torch.arange(127, dtype=torch.uint8, device=DEVICE)
    assert_bit_identical(storage, dq.segment_table([(0, 64, 0, 0)]), 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rope", ["plain", "cos-sin", "pairs"])
def test_every_workspace_dtype_and_rope_form_is_bit_identical(dtype, rope):
    storage = random_storage(dtype=dtype)
    cos, sin = random_rotary(14, 64)
    rotary = {"plain": None, "cos-sin": (cos, sin), "pairs": rotary_pairs(cos, sin)}[rope]
    assert_bit_identical(storage, SEGMENTS, 14, rotary)


@pytest.mark.parametrize("head_dim", [16, 48, 128])
def test_head_dims_of_one_three_and_eight_blocks(head_dim):
    storage = random_storage(head_dim=head_dim, heads=2, tokens=70, slots=2)
    assert_bit_identical(storage, dq.segment_table([(0, 70, 3, 1)]), 80, random_rotary(80, head_dim))


def test_many_segments_into_gaps_leave_other_rows_untouched_and_later_rows_win():
    storage = random_storage(tokens=40, slots=9)
    rows = gapped_rows()
    out = assert_bit_identical(storage, dq.segment_table(rows), 60, random_rotary(60, 64))
    gaps = uncovered(rows, 60, DEVICE)
    assert gaps.any() and (out[:, gaps] == 7.0).all()
    assert_bit_identical(storage, dq.segment_table([(0, 20, 0, 0), (20, 2, 5, 1)]), 20)


def test_a_window_longer_than_one_tile():
    storage = random_storage(batch=1, tokens=600, heads=1, head_dim=32, slots=2)
    assert_bit_identical(storage, dq.segment_table([(0, 300, 0, 0), (300, 300, 301, 1)]), 601, random_rotary(601, 32))


def test_non_contiguous_storage_and_workspace():
    dense = random_storage()
    storage = NVFP4Packed(**{**dense.__dict__, "codes": dense.codes.transpose(1, 2).contiguous().transpose(1, 2)})
    big = torch.full((2, 14, 3, 128), 7.0, dtype=torch.bfloat16, device=DEVICE)
    assert not storage.codes.is_contiguous()
    assert_bit_identical(storage, SEGMENTS, 14, random_rotary(14, 64), out=big[..., ::2])
    assert (big[..., 1::2] == 7.0).all()


def test_a_layer_pair_is_one_launch_and_equals_two_reference_calls():
    keys, values = random_storage(seed=1), random_storage(seed=2)
    rotary = random_rotary(14, 64)
    segments = SEGMENTS.to(DEVICE)
    outs = [torch.full((2, 14, 3, 64), 7.0, dtype=torch.bfloat16, device=DEVICE) for _ in range(4)]
    decode_reference(keys, segments, outs[0], rotary)
    decode_reference(values, segments, outs[1])
    with launch_arguments("ROLES") as launches:
        dequantize_pair_into(keys, values, segments, outs[2], outs[3], rotary)
    assert launches == [("_window_kernel", 2)]  # keys and values, one program per role
    assert torch.equal(bits(outs[2]), bits(outs[0])) and torch.equal(bits(outs[3]), bits(outs[1]))
    # Different layouts (here the value workspace's dtype) take one launch each.
    value_storage = random_storage(seed=2, dtype=torch.float32)
    out32, expected32 = (torch.zeros(2, 14, 3, 64, device=DEVICE) for _ in range(2))
    decode_reference(value_storage, segments, expected32)
    with launch_arguments("ROLES") as launches:
        dequantize_pair_into(keys, value_storage, segments, outs[2], out32, rotary)
    assert launches == [("_window_kernel", 1)] * 2 and torch.equal(bits(out32), bits(expected32))


def test_the_codec_routes_to_the_kernel_where_forced_and_refuses_what_it_cannot_take():
    storage = random_storage()
    segments = SEGMENTS.to(DEVICE)
    out = torch.zeros(2, 14, 3, 64, dtype=torch.bfloat16, device=DEVICE)
    with backend("triton"), counting_launches() as launches:
        dq.NVFP4Config().dequantize_into(storage, segments, out, random_rotary(14, 64))
    assert launches == ["_window_kernel"]
    with backend("torch"), counting_launches() as launches:
        dq.NVFP4Config().dequantize_into(storage, segments, out)
    assert launches == []
    wide = random_storage(dtype=torch.float64)
    with backend("triton"), pytest.raises(ValueError, match="the Triton kernels do not support this call: torch.float64 workspace"):
        dq.NVFP4Config().dequantize_into(wide, segments, torch.zeros(2, 14, 3, 64, dtype=torch.float64, device=DEVICE))
    half_rope = tuple(t.bfloat16() for t in random_rotary(14, 64))
    out.fill_(7.0)
    with backend("triton"), pytest.raises(ValueError, match="cos/sin that are not float32"):
        dq.NVFP4Config().dequantize_into(storage, segments, out, half_rope)
    assert (out == 7.0).all()


def test_round_trip_through_the_kernel_equals_the_reference_round_trip():
    x = torch.randn(1, 40, 2, 64, generator=torch.Generator().manual_seed(9)).bfloat16().to(DEVICE)
    packed = dq.quantize(x, "nvfp4")
    with backend("triton"):
        fast = dq.dequantize(packed)
    with backend("torch"):
        slow = dq.dequantize(packed)
    assert torch.equal(bits(fast), bits(slow)) and 0 < (fast.float() - x.float()).norm() / x.float().norm() < 0.12


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_kernel_on_cuda_equals_the_cpu_reference_at_full_geometry():
    # A chunk of 4680 tokens x 12 heads x 128 over two slots, every byte pattern: the kernel builds e2m1's 0 and
    # 1/2 as float32 subnormals (times 2^126), so this also checks the GPU keeps subnormals (no flush to zero).
    storage = random_storage(batch=1, tokens=4680, heads=12, head_dim=128, slots=2)
    segments = dq.segment_table([(0, 2000, 4680, 1), (2000, 2680, 0, 0)])
    cos, sin = random_rotary(6680, 128)
    out = torch.zeros(1, 6680, 12, 128, dtype=torch.bfloat16, device="cuda")
    dequantize_into(storage, segments.to("cuda"), out, rotary_pairs(cos, sin))
    cpu = NVFP4Packed(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in storage.__dict__.items()})
    expected = torch.zeros(1, 6680, 12, 128, dtype=torch.bfloat16)
    decode_reference(cpu, segments, expected, rotary_pairs(cos.cpu(), sin.cpu()))
    assert torch.equal(bits(out.cpu()), bits(expected))
