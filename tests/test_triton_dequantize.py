"""The Triton decoder against the reference decoder: bit-identical for every storage variant and segment layout."""

import pytest
import torch

import diffusers_qvg as dq
from diffusers_qvg.codecs.qvg import backend
from diffusers_qvg.codecs.qvg.decode import dequantize_into as reference
from diffusers_qvg.codecs.qvg.format import QVGPacked, allocate_qvg, pack_codes
from diffusers_qvg.codecs.qvg.triton.dequantize import dequantize_into as triton_dequantize

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled kernels on GPU, interpreted on CPU

VARIANTS = {
    "default-trits-e4m3": dq.QVGConfig(num_centroids=5),
    "int4-bits-bf16-2stages": dq.QVGConfig(bits=4, num_centroids=4, stages=2, centroid_dtype="bfloat16"),
    "asym-int2-fp16scales-headscale": dq.QVGConfig(
        symmetric=False, num_centroids=3, centroid_scale="head", scale_dtype="fp16", group_size=16
    ),
    "official-bits-no-stages": dq.QVGConfig(packing="bits", stages=0, group_size=32),
    "asym-int4-fp16-3stages": dq.QVGConfig(bits=4, symmetric=False, num_centroids=6, stages=3, centroid_dtype="float16"),
    "fp32-centroids-int16-ids": dq.QVGConfig(num_centroids=300, centroid_dtype="float32", group_size=8),
}


def random_storage(config, *, batch=2, tokens=13, heads=3, head_dim=64, slots=3, dtype=torch.bfloat16, seed=0) -> QVGPacked:
    """Storage filled with arbitrary valid bytes: every code, id, scale and centroid pattern the format allows."""
    g = torch.Generator().manual_seed(seed)
    s = allocate_qvg(config, batch, tokens, heads, head_dim, slots, dtype, "cpu")
    levels = 3 if config.trits else 2**config.bits
    u = torch.randint(0, levels, (batch, tokens, heads, head_dim // config.group_size, config.group_size), generator=g)
    s.codes.copy_(pack_codes(u, config))
    s.ids.copy_(torch.randint(0, config.centroids, s.ids.shape, generator=g))
    s.scale_shift.copy_(2.0 ** torch.randint(-12, 4, s.scale_shift.shape, generator=g))
    if s.centroid_scales is not None:
        s.centroid_scales.copy_(2.0 ** torch.randint(-12, 4, s.centroid_scales.shape, generator=g))
    for t in (s.scales, s.zeros, s.centroids):
        if t is None:
            continue
        if t.dtype == torch.float8_e4m3fn:
            bits = torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8)
            t.view(torch.uint8).copy_(torch.where(bits & 127 == 127, 0, bits))  # every pattern but NaN
        else:
            t.copy_(torch.randn(t.shape, generator=g) * 4)
    if s.config.symmetric:
        s.scales.abs_()
    return QVGPacked(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in s.__dict__.items()})


def random_rotary(window, head_dim, seed=1):
    g = torch.Generator().manual_seed(seed)
    angles = torch.randn(1, window, 1, head_dim // 2, generator=g, dtype=torch.float64) * 40
    return tuple(f(angles).repeat_interleave(2, dim=-1).float().to(DEVICE) for f in (torch.cos, torch.sin))


def assert_bit_identical(storage, segments, window, rotary=None, out_dtype=None, out=None):
    B, _, H, D = storage.shape
    if out is None:
        out = torch.full((B, window, H, D), 7.0, dtype=out_dtype or storage.dtype, device=DEVICE)
    segments = segments.to(DEVICE)
    expected = out.clone()
    reference(storage, segments, expected, rotary)
    triton_dequantize(storage, segments, out, rotary)
    assert torch.equal(out.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))
    return out


SEGMENTS = dq.segment_table([(6, 7, 1, 2), (0, 5, 8, 1), (5, 1, 0, 0)])  # out of order, a one-token segment


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rope"])
def test_every_storage_variant_is_bit_identical(name, rotary):
    storage = random_storage(VARIANTS[name])
    assert_bit_identical(storage, SEGMENTS, 14, random_rotary(14, 64) if rotary else None)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rope"])
def test_every_workspace_dtype_is_bit_identical(out_dtype, rotary):
    storage = random_storage(VARIANTS["default-trits-e4m3"], dtype=out_dtype)
    assert_bit_identical(storage, SEGMENTS, 14, random_rotary(14, 64) if rotary else None)


def test_head_dim_that_is_not_a_power_of_two():
    storage = random_storage(dq.QVGConfig(num_centroids=4, group_size=16, stages=2), head_dim=48, heads=2)
    assert_bit_identical(storage, SEGMENTS, 14, random_rotary(14, 48))


def test_many_segments_of_different_lengths_into_gaps_leave_other_rows_untouched():
    storage = random_storage(VARIANTS["default-trits-e4m3"], tokens=40, slots=9)
    rows, src, dst = [], 0, 60
    for i, n in enumerate([1, 7, 3, 9, 1, 2, 5, 11, 1]):  # 40 tokens, written back to front with gaps
        dst -= n + (i % 2)
        rows.append((src, n, dst, (i * 4) % 9))
        src += n
    out = assert_bit_identical(storage, dq.segment_table(rows), 60, random_rotary(60, 64))
    covered = torch.zeros(60, dtype=torch.bool, device=DEVICE)
    for _, n, d, _ in rows:
        covered[d : d + n] = True
    assert (~covered).any() and (out[:, ~covered] == 7.0).all()


def test_non_contiguous_storage_workspace_table_and_rotary():
    config = VARIANTS["asym-int2-fp16scales-headscale"]
    dense = random_storage(config)

    def strided(t):  # same values, token-major memory turned head-major
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    storage = QVGPacked(**{**dense.__dict__, **{n: strided(getattr(dense, n)) for n in ("codes", "scales", "zeros", "ids")}})
    assert not storage.codes.is_contiguous()
    table = torch.zeros(3, 8, dtype=torch.int32, device=DEVICE)
    table[:, ::2] = SEGMENTS.tensor
    segments = dq.SegmentTable(SEGMENTS.rows, table[:, ::2])
    big = torch.full((2, 14, 3, 128), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out = big[..., ::2]
    cos, sin = random_rotary(14, 64)
    rotary = (cos.expand(1, 14, 3, 64)[:, :, 1:2], torch.cat([sin, sin], dim=-1)[..., ::2])
    assert not (segments.tensor.is_contiguous() or out.is_contiguous() or rotary[1].is_contiguous())
    assert_bit_identical(storage, segments, 14, rotary, out=out)
    assert (big[..., 1::2] == 7.0).all()


def test_later_rows_win_where_destinations_overlap():
    storage = random_storage(VARIANTS["default-trits-e4m3"], tokens=24)
    assert_bit_identical(storage, dq.segment_table([(0, 6, 0, 0), (6, 4, 3, 1)]), 10)
    # A later segment inside an earlier one: the ends of a program's rows agree on a segment, the middle does not.
    assert_bit_identical(storage, dq.segment_table([(0, 20, 0, 0), (20, 2, 5, 1)]), 20)


def test_one_long_segment_in_the_middle_of_the_window():
    storage = random_storage(VARIANTS["default-trits-e4m3"], tokens=50)
    assert_bit_identical(storage, dq.segment_table([(3, 45, 9, 2)]), 60, random_rotary(60, 64))


def test_backend_override_routes_the_codec_verb():
    config = VARIANTS["default-trits-e4m3"]
    storage = random_storage(config)
    outs = {}
    for name in ("torch", "triton"):
        outs[name] = torch.zeros(2, 14, 3, 64, dtype=torch.bfloat16, device=DEVICE)
        with backend(name):
            config.dequantize_into(storage, SEGMENTS.to(DEVICE), outs[name], random_rotary(14, 64))
    assert torch.equal(outs["torch"], outs["triton"]) and outs["torch"].abs().sum() > 0


def test_unknown_backend_and_unsupported_workspace_are_refused_before_writing():
    with pytest.raises(ValueError, match="'triton' or 'torch'"):
        with backend("cuda"):
            pass
    storage = random_storage(VARIANTS["default-trits-e4m3"], dtype=torch.float64)
    out = torch.full((2, 14, 3, 64), 7.0, dtype=torch.float64, device=DEVICE)
    segments = SEGMENTS.to(DEVICE)
    with pytest.raises(ValueError, match="torch backend"):
        triton_dequantize(storage, segments, out)
    with pytest.raises(ValueError, match="backend\\('torch'\\)"), backend("triton"):
        storage.config.dequantize_into(storage, segments, out)
    assert (out == 7.0).all()
    with backend("torch"):  # float64 decodes on the reference, exactly
        storage.config.dequantize_into(storage, segments, out)
    assert not (out == 7.0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", VARIANTS)
def test_window_at_self_forcing_size_is_bit_identical_on_gpu(name):
    config = VARIANTS[name]
    chunk, heads, D = 4680, 12, 128
    storage = random_storage(config, batch=1, tokens=7 * chunk, heads=heads, head_dim=D, slots=7)
    segments = dq.segment_table([(i * chunk, chunk, (6 - i) * chunk, i) for i in range(7)], device="cuda")
    cos, sin = random_rotary(7 * chunk, D)
    for rotary in (None, (cos, sin)):
        expected = torch.empty(1, 7 * chunk, heads, D, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(expected)
        reference(storage, segments, expected, rotary)
        triton_dequantize(storage, segments, out, rotary)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
