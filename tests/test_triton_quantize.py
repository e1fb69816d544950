"""The Triton residual quantizer against the reference encoder: same codes, scales, zeros and shift."""

import copy

import pytest
import torch
import triton
import triton.language as tl

import diffusers_qvg as dq
from diffusers_qvg.codecs.groups import scale_candidates
from diffusers_qvg.codecs.qvg import backend
from diffusers_qvg.codecs.qvg.triton.encoder import quantize_residual_into
from diffusers_qvg.codecs.qvg.triton import INTERPRETING
from diffusers_qvg.codecs.qvg.triton.numerics import quotient, round_scale
from diffusers_qvg.metrics import rel_l2

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled kernels on GPU, interpreted on CPU

VARIANTS = {
    "default": dq.QVGConfig(num_centroids=4),
    "coarse-scale-search": dq.QVGConfig(num_centroids=4, scale_search="mse-coarse"),
    "int4-fp16scales-bf16-2stages": dq.QVGConfig(bits=4, num_centroids=4, stages=2, centroid_dtype="bfloat16", scale_dtype="fp16"),
    "asym-int2-headscale": dq.QVGConfig(symmetric=False, num_centroids=3, centroid_scale="head", group_size=16),
    "trits-groups-of-4-2stages": dq.QVGConfig(num_centroids=3, group_size=4, stages=2),  # tl.sum's squares
    "asym-int4-fp16-no-stages": dq.QVGConfig(symmetric=False, bits=4, scale_dtype="fp16", stages=0, group_size=32),
    "official": dq.QVGConfig.official().with_(num_centroids=4),
    "fp32-centroids-int16-ids": dq.QVGConfig(
        num_centroids=257, centroid_dtype="float32", group_size=8, kmeans_iters=1, kmeans_init="strided"
    ),
}
RESIDUAL_FIELDS = ("codes", "scales", "zeros", "scale_shift")


def chunk(N=13, H=3, D=64, dtype=torch.bfloat16, seed=0):
    """Heads of very different magnitudes (the per-head shift must follow them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, N, H, D, generator=g) * torch.logspace(-4, 3, H).view(1, 1, H, 1)
    return (x + torch.randn(2, 1, H, D, generator=g)).to(dtype).to(DEVICE)


def reference_then_kernel(config, x, capacity=None, token_start=0, slot=0):
    """Encode with the reference, then let the kernel rewrite the residual fields from the same ids and centroids."""
    B, N, H, D = x.shape
    storage = config.allocate(batch=B, capacity_tokens=capacity or N, heads=H, head_dim=D, num_slots=slot + 1, dtype=x.dtype, device=DEVICE)
    with backend("torch"):
        config.quantize_into(storage, x, token_start=token_start, slot=slot)
    ours = copy.deepcopy(storage)
    for name in RESIDUAL_FIELDS:
        if getattr(ours, name) is not None:
            getattr(ours, name).view(torch.uint8).fill_(0xAB if name != "scale_shift" else 0)
    quantize_residual_into(ours, x, scale_candidates(config.scale_search, torch.float32, DEVICE), token_start=token_start, slot=slot)
    return storage, ours


def assert_same_bytes(expected, actual):
    for name, t in expected.tensors().items():
        assert torch.equal(t.view(torch.uint8), getattr(actual, name).view(torch.uint8)), name


@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_gives_the_reference_codes_and_scales(name):
    x = chunk(N=257, H=1, D=16) if VARIANTS[name].centroids > 256 else chunk()  # int16 ids need > 256 tokens
    expected, ours = reference_then_kernel(VARIANTS[name], x)
    assert_same_bytes(expected, ours)


@pytest.mark.parametrize("tokens", [32, 64])
def test_the_codes_kernel_tile_does_not_change_the_bytes(tokens, monkeypatch):
    """Ternary codes at 64 tokens per program (shipped) and at 32 (bench_kernels's comparison row), over
    several programs per problem: the reference's bytes either way."""
    from diffusers_qvg.codecs.qvg.triton import quantize

    monkeypatch.setitem(quantize.BLOCK_TOKENS, True, tokens)
    expected, ours = reference_then_kernel(VARIANTS["default"], chunk(N=150, H=2))
    assert_same_bytes(expected, ours)


@pytest.mark.parametrize("ties_in_axis_order", [True, False])
@pytest.mark.parametrize("name", ["default", "asym-int2-headscale"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_both_arrangements_give_the_reference_bytes(name, head_dim, ties_in_axis_order, monkeypatch):
    """The codes kernel's residual axes follow how the installed Triton hands out threads (3.6 and 3.9
    differ, ``quantize.arrangement``); the interpreter runs one Triton, so both orders are run here, with a
    thread per group (head_dim 128: 64 ternary tokens x 2 groups, or 16 tokens x 8 groups of 16) and with
    groups spread over threads (head_dim 64)."""
    from diffusers_qvg.codecs.qvg.triton import quantize

    monkeypatch.setattr(quantize, "TIES_IN_AXIS_ORDER", ties_in_axis_order)
    assert_same_bytes(*reference_then_kernel(VARIANTS[name], chunk(N=150, H=2, D=head_dim)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_input_dtypes(dtype):
    expected, ours = reference_then_kernel(VARIANTS["default"], chunk(dtype=dtype))
    assert_same_bytes(expected, ours)


def test_writes_only_its_token_range_and_slot():
    expected, ours = reference_then_kernel(VARIANTS["asym-int2-headscale"], chunk(N=7), capacity=20, token_start=9, slot=2)
    for name in ("codes", "scales", "zeros"):
        t = getattr(ours, name).view(torch.uint8)
        assert torch.equal(t[:, 9:16], getattr(expected, name).view(torch.uint8)[:, 9:16]), name
        assert (t[:, :9] == 0xAB).all() and (t[:, 16:] == 0xAB).all(), name
    assert torch.equal(ours.scale_shift[2], expected.scale_shift[2]) and (ours.scale_shift[:2] == 0).all()


def test_one_token_odd_head_dim_and_strided_input():
    config = dq.QVGConfig(num_centroids=1, group_size=16)
    x = chunk(N=1, D=48)
    expected, ours = reference_then_kernel(config, x)
    assert_same_bytes(expected, ours)
    strided = chunk(N=11).transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    assert_same_bytes(*reference_then_kernel(VARIANTS["default"], strided))


@pytest.mark.parametrize("scale", [0.0, 1e-30, 1e9])
def test_zero_tiny_and_huge_heads(scale):
    x = (chunk(dtype=torch.float32) * scale).contiguous()
    for config in (VARIANTS["default"], VARIANTS["asym-int2-headscale"]):
        assert_same_bytes(*reference_then_kernel(config, x))


def test_video_derived_chunk():
    from diffusers_qvg.video_kv import VideoKVSpec, video_kv

    data = video_kv(VideoKVSpec(height=32, width=48, patch=8, heads=2, head_dim=64), chunks=1)
    assert_same_bytes(*reference_then_kernel(dq.QVGConfig(num_centroids=8), data.key_pre_rope.to(DEVICE)))


def test_triton_encoder_is_deterministic_and_as_accurate_as_the_reference():
    config = dq.QVGConfig(num_centroids=6, kmeans_iters=3)
    x = chunk(N=24, H=2)
    with backend("triton"):
        a, b = config.quantize(x), config.quantize(x)
        decoded = dq.dequantize(a)
    assert_same_bytes(a, b)
    with backend("torch"):
        reference = dq.dequantize(config.quantize(x))
    ours_err, ref_err = rel_l2(decoded, x), rel_l2(reference, x)
    assert ours_err <= ref_err * 1.05 + 1e-6


def test_forcing_triton_on_float64_raises_before_writing():
    config = VARIANTS["default"]
    x = chunk(dtype=torch.float64)
    storage = config.allocate(batch=2, capacity_tokens=13, heads=3, head_dim=64, num_slots=1, dtype=x.dtype, device=DEVICE)
    before = copy.deepcopy(storage)
    with pytest.raises(ValueError, match="backend\\('torch'\\)"):
        with backend("triton"):
            config.quantize_into(storage, x, token_start=0, slot=0)
    assert_same_bytes(before, storage)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["default", "official", "asym-int2-headscale"])
def test_self_forcing_chunk_gives_the_reference_codes_on_gpu(name):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 4680, 12, 128, device="cuda", generator=g) + torch.randn(1, 1, 12, 128, device="cuda", generator=g)
    expected, ours = reference_then_kernel(VARIANTS[name].with_(num_centroids=256), x.bfloat16())
    assert torch.equal(expected.scale_shift, ours.scale_shift)
    # Only near-ties of the MSE choice (float32 sums in another order) may differ: a handful of groups at most.
    for field in ("codes", "scales"):
        differ = getattr(expected, field).view(torch.uint8) != getattr(ours, field).view(torch.uint8)
        assert differ.float().mean().item() < 1e-4, field


@triton.jit
def _round_scale(v_ptr, out_ptr, n, FMT_MAX: tl.constexpr, E4M3: tl.constexpr, SOFTWARE: tl.constexpr, BLOCK: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + at, mask=at < n)
    tl.store(out_ptr + at, round_scale(v, FMT_MAX, E4M3, SOFTWARE), mask=at < n)


@pytest.mark.parametrize(
    "fmt, software",
    [
        (torch.float8_e4m3fn, True),
        pytest.param(torch.float8_e4m3fn, False, marks=[pytest.mark.gpu, pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="the conversion instructions need CUDA")]),
        (torch.float16, False),
    ],
)
def test_scale_rounding_equals_the_cast(fmt, software):
    """The scale search's rounding (the bit arithmetic, or the GPU's conversion instructions), bit for bit the
    saturated cast's, on every representable value of the format, every midpoint between neighbours (ties to
    even) and the float32 values either side of it, zero, float32 subnormals, random values up to the
    format's maximum and values above it."""
    grid = torch.arange(256 if fmt == torch.float8_e4m3fn else 65536, dtype=torch.int32)
    grid = grid.to(torch.uint8 if fmt == torch.float8_e4m3fn else torch.int16).view(fmt).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mids = (grid[:-1] + grid[1:]) / 2  # exact in float32
    bits = mids.view(torch.int32)
    near = torch.cat([(bits - 1).view(torch.float32), (bits + 1).view(torch.float32)])
    rand = torch.rand(4096, generator=torch.Generator().manual_seed(0)) * grid.max()
    top = grid.max().item()
    edge = torch.tensor([0.0, 1e-45, 1e-40, 2.0**-126, 2.0**-20, 2.0**-6, 2.0**-14, top * 1.03, top * 1.5, 2.0**60, float("inf")])
    v = torch.cat([grid, mids, near, rand, edge]).to(DEVICE)
    out = torch.empty_like(v)
    _round_scale[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), top, fmt == torch.float8_e4m3fn, software, BLOCK=1024)
    assert torch.equal(out.view(torch.int32), v.clamp(max=top).to(fmt).float().view(torch.int32))


@triton.jit
def _quotient(a_ptr, b_ptr, inv_ptr, out_ptr, n, BLOCK: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a, b, inv = tl.load(a_ptr + at, mask=at < n), tl.load(b_ptr + at, mask=at < n), tl.load(inv_ptr + at, mask=at < n)
    tl.store(out_ptr + at, quotient(a, b, inv), mask=at < n)


def test_division_free_quotient_is_the_rounded_quotient():
    """``numerics.quotient`` (the codes kernel's levels and scales without a division) is IEEE float32
    division, bit for bit: for every 11-bit significand of ``b`` at both ends of its range and at the scale
    divisors 3, 7 and 15, every ``a`` within 6 ulps of each level threshold ``+-(k + 1/2) b`` (k < 15), and
    random quotients from 2^-26 to 2^20; with the reciprocal correctly rounded and off by up to 2 ulps (the
    GPU's fast division)."""
    gen = torch.Generator().manual_seed(0)
    significands = 1 + torch.arange(1024, dtype=torch.float64) / 1024
    b = torch.cat([significands * 2.0**e for e in (-61, -30, 0, 1, 2, 3, 30, 67)]).float()
    m = torch.arange(15, dtype=torch.float32) + 0.5
    thresholds = (b[:, None].double() * torch.cat([m, -m])[None, :]).float()  # exact: 16 bits at most
    ulps = torch.arange(-6, 7, dtype=torch.int32)
    a_near = (thresholds.view(torch.int32)[..., None] + ulps).view(torch.float32).reshape(-1)
    b_near = b[:, None].expand(-1, thresholds.shape[1] * len(ulps)).reshape(-1)
    b_rand = b[torch.randint(len(b), (1 << 20,), generator=gen)]
    q = (torch.rand(1 << 20, generator=gen, dtype=torch.float64) * 2 - 1) * 2.0 ** torch.randint(-26, 21, (1 << 20,), generator=gen)
    a_rand = (b_rand.double() * q).float()
    a, b_all = torch.cat([a_near, a_rand]), torch.cat([b_near, b_rand])
    expected = a / b_all
    for off in (-2, -1, 0, 1, 2):
        inv = ((1.0 / b_all).view(torch.int32) + off).view(torch.float32)
        args = [t.contiguous().to(DEVICE) for t in (a, b_all, inv)]
        out = torch.empty_like(args[0])
        _quotient[(triton.cdiv(a.numel(), 1 << 16),)](*args, out, a.numel(), BLOCK=1 << 16)
        assert torch.equal(out.cpu().view(torch.int32), expected.view(torch.int32)), off

