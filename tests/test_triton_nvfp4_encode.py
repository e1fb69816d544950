"""The Triton NVFP4 encoder against the reference encoder: the same bytes for both scale rules, every input dtype,
ties, signed zeros, tiny and huge heads, odd sizes; routed by the codec where it runs."""

import pytest
import torch

import diffusers_qvg as dq
from diffusers_qvg.codecs.kernel_backend import backend
from diffusers_qvg.codecs.nvfp4 import codec as nvfp4_codec
from diffusers_qvg.codecs.nvfp4.codec import encode_blocks_reference, second_level_scale, tree_sum16
from diffusers_qvg.codecs.nvfp4.format import E2M1_GRID, SCALE_RULES
from diffusers_qvg.codecs.nvfp4.triton_encode import encode_blocks
from launch_counts import counting_launches

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled kernels on GPU, interpreted on CPU
RULES = list(SCALE_RULES)


def assert_same_bytes(x, rule):
    g = second_level_scale(x, SCALE_RULES[rule][0])
    codes, scales = encode_blocks(x, g, rule)
    ref_codes, ref_scales = encode_blocks_reference(x, g, rule)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))
    return codes, scales


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_heads_encode_to_the_reference_bytes(rule, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, 3, 64, generator=g) * torch.tensor([1e-3, 1.0, 40.0]).view(1, 1, 3, 1)
    x[:, :, :, ::7] *= 8  # outliers: blocks whose largest value differs from the rest
    assert_same_bytes(x.to(dtype).to(DEVICE), rule)


@pytest.mark.parametrize("rule", RULES)
def test_ties_zeros_and_values_on_the_grid_encode_to_the_reference_bytes(rule):
    # Every block holds its largest magnitude 6 (so scales are exact) and values at the e2m1 midpoints (ties), on
    # the grid, just beside them, signed zeros and values that round to 0.
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    grid = torch.tensor(E2M1_GRID)
    values = torch.cat([mids, -mids, grid, -grid, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(9.0)),
                        torch.tensor([-0.0, 1e-30, -1e-30, 0.1, -0.1])])
    values = torch.cat([values, torch.zeros((-values.numel()) % 15)]).view(-1, 15)
    blocks = torch.cat([torch.full((values.shape[0], 1), 6.0), values], dim=1)  # [blocks, 16]
    x = blocks.reshape(1, -1, 1, 16).to(DEVICE)
    assert_same_bytes(x, rule)


@pytest.mark.parametrize("magnitude", [1e-30, 1e20])
def test_tiny_and_huge_heads_encode_to_the_reference_bytes(magnitude):
    x = torch.randn(1, 20, 2, 32, generator=torch.Generator().manual_seed(1)) * magnitude
    assert_same_bytes(x.to(DEVICE), "four-over-six")


def test_zero_heads_and_a_head_dim_of_three_blocks():
    x = torch.randn(1, 70, 3, 48, generator=torch.Generator().manual_seed(2))
    x[:, :, 1] = 0  # g = 1, every scale at the e4m3 floor, every code 0
    codes, scales = assert_same_bytes(x.to(DEVICE), "four-over-six")
    assert (codes[:, :, 1] == 0).all()


def test_strided_input_encodes_like_its_contiguous_copy():
    x = torch.randn(1, 12, 2, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    codes, scales = assert_same_bytes(strided, "four-over-six")
    assert torch.equal(codes, encode_blocks(x, second_level_scale(x, 256.0), "four-over-six")[0])


def _halves_first(e):
    for _ in range(4):
        e = e[..., : e.shape[-1] // 2] + e[..., e.shape[-1] // 2 :]
    return e[..., 0]


def _left_to_right(e):
    total = torch.zeros(e.shape[:-1])
    for i in range(e.shape[-1]):
        total = total + e[..., i]
    return total


def test_exact_ties_are_decided_by_the_tree_sums_rounding(monkeypatch):
    """Blocks whose two candidates' squared errors are the same 16 numbers in another order: their sums are equal
    in exact arithmetic, so only the rounding of the summation order decides. With g = 1 (head max 1536) the
    candidates' scales are 256 (max -> 6) and 384 (max -> 4); each pair (1152 + d, 1024 - d), d a multiple of
    2^-13 (both exact in float32), has errors (128 + d)^2 and d^2 under the first and d^2 and (128 + d)^2 under
    the second. Other orders decide some of these blocks the other way: a kernel summing in one fails here."""
    gen = torch.Generator().manual_seed(0)
    n = 400
    d = torch.round((torch.rand(n, 7, generator=gen) * 60 + 0.5) * 2**13) / 2**13
    slots = torch.stack([torch.randperm(15, generator=gen) + 1 for _ in range(n)])  # slot 0 holds the max
    blocks = torch.zeros(n, 16)
    blocks[:, 0] = 1536.0
    blocks.scatter_(1, slots[:, :7], 1152 + d)
    blocks.scatter_(1, slots[:, 7:14], 1024 - d)
    x = blocks.view(1, n, 1, 16)
    g = second_level_scale(x, SCALE_RULES["four-over-six"][0])
    assert g.item() == 1.0
    paired = (blocks > 0) & (blocks < 1536)  # each pair decodes to 1024 under the first scale, 1152 under the second
    e6, e4 = ((torch.where(paired, level, blocks) - blocks).square() for level in (1024.0, 1152.0))
    assert torch.equal(e6.sort(dim=1).values, e4.sort(dim=1).values)  # the same numbers: an exact tie

    _, scales = assert_same_bytes(x.to(DEVICE), "four-over-six")
    chosen = scales.view(torch.uint8).flatten().cpu()
    assert set(chosen.tolist()) == {0x78, 0x7C}  # 256 and 384: the rounding picks each often
    for other in (_halves_first, _left_to_right):
        monkeypatch.setattr(nvfp4_codec, "tree_sum16", other)
        decided = encode_blocks_reference(x, g, "four-over-six")[1].view(torch.uint8).flatten()
        assert (decided != chosen).sum() > 10


def test_the_tree_sum_adds_neighbours_first():
    u = 2.0**-24  # half an ulp of 1: 1 + u rounds to 1
    e = torch.tensor([1.0, u, u, -1.0] + [0.0] * 12)  # (1 + u) + (u - 1) = 1 - (1 - u) = u; left to right: 0
    assert tree_sum16(e).item() == u
    sequential = torch.tensor(0.0)
    for v in e:
        sequential = sequential + v
    assert sequential.item() == 0.0  # so the order is the result's


def test_the_codec_routes_its_encoder_and_packs_what_the_reference_packs():
    x = torch.randn(1, 40, 2, 64, generator=torch.Generator().manual_seed(4)).bfloat16().to(DEVICE)
    with backend("triton"), counting_launches() as launches:
        fast = dq.quantize(x, "nvfp4")
    assert launches == ["_encode_kernel"]
    with backend("torch"), counting_launches() as launches:
        slow = dq.quantize(x, "nvfp4")
    assert launches == []
    for name in ("codes", "scales", "tensor_scale"):
        assert torch.equal(getattr(fast, name).view(torch.uint8), getattr(slow, name).view(torch.uint8)), name
    with backend("triton"), pytest.raises(ValueError, match="the Triton kernels do not support this call: torch.float64 input"):
        dq.quantize(x.double(), "nvfp4")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_encoder_on_cuda_equals_the_cpu_reference_at_full_geometry():
    x = torch.randn(1, 4680, 12, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    for rule in RULES:
        g = second_level_scale(x, SCALE_RULES[rule][0])
        codes, scales = encode_blocks(x.cuda(), g.cuda(), rule)
        ref_codes, ref_scales = encode_blocks_reference(x, g, rule)
        assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu().view(torch.uint8), ref_scales.view(torch.uint8))
