"""The Triton decoder against the reference decoder: bit-identical for every storage variant and segment layout."""

import pytest
import torch

import diffusers_qvg as dq
from diffusers_qvg.codecs.qvg import backend
from diffusers_qvg.codecs.qvg.decode import dequantize_into as reference
from diffusers_qvg.codecs.qvg.format import QVGPacked, allocate_qvg, pack_codes
from diffusers_qvg.codecs.qvg.triton.dequantize import dequantize_into as triton_dequantize
from segment_rows import gapped_rows, uncovered

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
    "trits-e4m3-scale-per-centroid-2stages": dq.QVGConfig(num_centroids=7, centroid_scale="centroid", stages=2),
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
    rows = gapped_rows()
    out = assert_bit_identical(storage, dq.segment_table(rows), 60, random_rotary(60, 64))
    gaps = uncovered(rows, 60, DEVICE)
    assert gaps.any() and (out[:, gaps] == 7.0).all()


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
    values = random_storage(config, batch=1, tokens=7 * chunk, heads=heads, head_dim=D, slots=7, seed=1)
    assert_pair_bit_identical(storage, values, segments, 7 * chunk, rotary_pairs(cos, sin))  # the cache's read


# --- The window decoder's own paths: tiles, long and short segments, one launch for K and V -------------------------

from diffusers_qvg.codecs.base import TILE_TOKENS  # noqa: E402
from diffusers_qvg.codecs.qvg.triton import dequantize as window  # noqa: E402
from diffusers_qvg.codecs.qvg.triton.dequantize import dequantize_pair_into as triton_pair  # noqa: E402
from diffusers_qvg.rotary import RotaryPairs, rotary_pairs  # noqa: E402


def assert_pair_bit_identical(keys, values, segments, window_tokens, rotary=None):
    """One launch for K (rotated) and V against the reference decoding each; both workspaces prefilled with 7."""
    B, _, H, D = keys.shape
    outs = [torch.full((B, window_tokens, H, D), 7.0, dtype=keys.dtype, device=DEVICE) for _ in range(4)]
    segments = segments.to(DEVICE)
    reference(keys, segments, outs[0], rotary)
    reference(values, segments, outs[1])
    triton_pair(keys, values, segments, outs[2], outs[3], rotary)
    for got, want in ((outs[2], outs[0]), (outs[3], outs[1])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return outs[2], outs[3]


def covered_mask(rows, window_tokens):
    covered = torch.zeros(window_tokens, dtype=torch.bool, device=DEVICE)
    for _, n, d, _ in rows:
        covered[d : d + n] = True
    return covered


@pytest.mark.parametrize("name", VARIANTS)
def test_one_launch_decodes_keys_and_values_of_every_variant_bit_identically(name):
    """Segments longer than a block (the shifted last block), shorter ones (masked rows), a gap, batch 2 (CFG)."""
    config = VARIANTS[name]
    keys = random_storage(config, tokens=120, seed=1)
    values = random_storage(config, tokens=120, seed=2)
    rows = [(70, 50, 0, 2), (0, 41, 53, 0), (41, 5, 94, 1), (46, 24, 100, 1)]  # 50 and 41 tokens: 2 blocks each
    k, v = assert_pair_bit_identical(keys, values, dq.segment_table(rows), 130, random_rotary(130, 64))
    gap = ~covered_mask(rows, 130)
    assert gap.any() and (k[:, gap] == 7.0).all() and (v[:, gap] == 7.0).all()


@pytest.mark.parametrize("paired", [False, True], ids=["cos-sin", "pairs"])
def test_rotary_pairs_rotate_exactly_as_dense_cos_sin(paired):
    storage = random_storage(VARIANTS["default-trits-e4m3"], tokens=80)
    cos, sin = random_rotary(90, 64)
    rotary = rotary_pairs(cos, sin) if paired else (cos, sin)
    segments = dq.segment_table([(0, 80, 5, 1)])
    out = assert_bit_identical(storage, segments, 90, rotary)
    dense = torch.full_like(out, 7.0)
    reference(storage, segments.to(DEVICE), dense, (cos, sin))
    assert torch.equal(out, dense)  # both forms give the same bytes


def test_a_tile_boundary_and_a_partial_last_block_inside_one_long_segment():
    """TILE_TOKENS + 37 tokens: a full tile (BLOCK_T blocks) then a tile whose last block is shifted back."""
    n = TILE_TOKENS + 37
    storage = random_storage(VARIANTS["default-trits-e4m3"], batch=1, tokens=n + 3, heads=2, slots=1)
    assert_bit_identical(storage, dq.segment_table([(3, n, 1, 0)]), n + 9, random_rotary(n + 9, 64))


@pytest.mark.parametrize("heads, head_dim, group", [(5, 96, 32), (1, 48, 16), (3, 40, 8)])
def test_odd_head_counts_and_head_dims_that_are_not_powers_of_two(heads, head_dim, group):
    config = dq.QVGConfig(num_centroids=4, group_size=group, stages=2)
    keys = random_storage(config, tokens=70, heads=heads, head_dim=head_dim, seed=3)
    values = random_storage(config, tokens=70, heads=heads, head_dim=head_dim, seed=4)
    rows = [(0, 40, 30, 0), (40, 30, 0, 2)]
    assert_pair_bit_identical(keys, values, dq.segment_table(rows), 75, random_rotary(75, head_dim))


@pytest.mark.parametrize("group", [3, 6, 12])
def test_groups_that_split_runs_of_eight_channels(group):
    """Runs of 1, 2 and 4 channels (the largest power of two dividing the group), trit and 2-bit packings."""
    for config in (dq.QVGConfig(num_centroids=3, group_size=group), dq.QVGConfig(num_centroids=3, group_size=group, packing="bits")):
        storage = random_storage(config, tokens=40, head_dim=48)
        assert window.run_layout(config, 48)[0] == min(8, group & -group)
        assert_bit_identical(storage, dq.segment_table([(0, 36, 2, 1), (36, 4, 40, 0)]), 44, random_rotary(44, 48))


def test_a_240_frame_window_of_79_segments_in_any_order():
    """The cache's longest window (79 packed chunks, here 36 tokens each, 1 head), segments shuffled and placed
    back to front: one tile per segment, each program finds its segment without searching the table."""
    chunk, count = 36, 79
    config = VARIANTS["default-trits-e4m3"]
    keys = random_storage(config, batch=1, tokens=chunk * count, heads=1, slots=count, seed=5)
    values = random_storage(config, batch=1, tokens=chunk * count, heads=1, slots=count, seed=6)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(0)).tolist()
    rows = [(i * chunk, chunk, (count - 1 - k) * chunk + 4, i) for k, i in enumerate(order)]
    segments = dq.segment_table(rows)
    assert len(segments.tiles) == count
    assert_pair_bit_identical(keys, values, segments, chunk * (count + 1), random_rotary(chunk * (count + 1), 64))


def test_overlapping_long_segments_resolve_to_the_later_rows():
    storage = random_storage(VARIANTS["int4-bits-bf16-2stages"], tokens=200)
    rows = [(0, 150, 0, 0), (150, 40, 60, 1), (10, 50, 130, 2), (100, 3, 0, 1)]  # inner, tail and head overlaps
    assert_bit_identical(storage, dq.segment_table(rows), 190, random_rotary(190, 64))


def test_pairs_of_different_layouts_take_one_launch_each():
    """Keys and values whose strides differ cannot share a launch; the result is the same."""
    config = VARIANTS["asym-int2-fp16scales-headscale"]
    keys = random_storage(config, tokens=50, seed=7)
    dense = random_storage(config, tokens=50, seed=8)
    values = QVGPacked(**{**dense.__dict__, "codes": dense.codes.transpose(1, 2).contiguous().transpose(1, 2)})
    launches = []
    real = window._window_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    window._window_kernel = Spy()
    try:
        assert_pair_bit_identical(keys, values, dq.segment_table([(0, 50, 0, 1)]), 50, random_rotary(50, 64))
        assert [g[2] for g in launches] == [2, 2]  # batch 2 x one role, twice
        launches.clear()
        assert_pair_bit_identical(keys, dense, dq.segment_table([(0, 50, 0, 1)]), 50, random_rotary(50, 64))
        assert [g[2] for g in launches] == [4]  # batch 2 x both roles, once
    finally:
        window._window_kernel = real


def test_every_codec_decodes_a_pair_as_two_calls():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 24, 2, 64, generator=g)
    cos, sin = random_rotary(30, 64)
    cos, sin = cos.cpu(), sin.cpu()
    table = dq.segment_table([(0, 24, 3, 0)])
    for config in (dq.BF16Config(), dq.KIVIConfig(key_group_tokens=8), dq.QVGConfig(num_centroids=4)):
        kv = [config.quantize(x, role=r) for r in ("key", "value")]
        pair = [torch.zeros(1, 30, 2, 64) for _ in range(2)]
        single = [torch.zeros(1, 30, 2, 64) for _ in range(2)]
        with backend("torch"):
            config.dequantize_pair_into(kv[0], kv[1], table, *pair, rotary_pairs(cos, sin))
            config.dequantize_into(kv[0], table, single[0], (cos, sin))
            config.dequantize_into(kv[1], table, single[1])
        assert torch.equal(pair[0], single[0]) and torch.equal(pair[1], single[1]) and pair[0].abs().sum() > 0


def test_pair_calls_are_checked_before_either_workspace_is_written():
    config = VARIANTS["default-trits-e4m3"]
    keys, values = random_storage(config), random_storage(config)
    good = torch.full((2, 14, 3, 64), 7.0, dtype=torch.bfloat16, device=DEVICE)
    bad = torch.full((2, 14, 3, 32), 7.0, dtype=torch.bfloat16, device=DEVICE)
    with backend("triton"):
        with pytest.raises(ValueError, match="out must have shape"):
            config.dequantize_pair_into(keys, values, SEGMENTS.to(DEVICE), good, bad)
        with pytest.raises(ValueError, match="rotary cos/sin"):
            config.dequantize_pair_into(keys, values, SEGMENTS.to(DEVICE), good, good.clone(), random_rotary(9, 64))
    assert (good == 7.0).all()


def test_the_kernel_refuses_what_it_cannot_decode():
    config = VARIANTS["default-trits-e4m3"]
    storage = random_storage(config, tokens=20)
    out = torch.full((2, 20, 3, 64), 7.0, dtype=torch.bfloat16, device=DEVICE)
    table = dq.segment_table([(0, 20, 0, 0)], DEVICE)
    cos, sin = random_rotary(20, 64)
    with pytest.raises(ValueError, match="float32 cos/sin"):
        triton_dequantize(storage, table, out, (cos.double(), sin.double()))
    with pytest.raises(ValueError, match="float32 cos/sin"):
        triton_dequantize(storage, table, out, RotaryPairs(cos.half()))
    with pytest.raises(ValueError, match="at most 65535"):
        triton_dequantize(storage, dq.segment_table([(0, 65536 * TILE_TOKENS, 0, 0)], DEVICE), out)
    wide = torch.empty_strided((1, 2, 1, 64), (64, 2**23 + 64, 64, 1), dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="more than 2\\^31"):
        triton_dequantize(storage, table, wide)
    odd = random_storage(dq.QVGConfig(num_centroids=4, group_size=3), tokens=20, head_dim=9)
    with pytest.raises(ValueError, match="even head_dim"):
        triton_dequantize(odd, table, torch.zeros(2, 20, 3, 9, dtype=torch.bfloat16, device=DEVICE), random_rotary(20, 8))
    assert (out == 7.0).all()
