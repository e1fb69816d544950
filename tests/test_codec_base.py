"""The codec interface and the dense reference format."""

import pytest
import torch

import diffusers_qvg as dq
from diffusers_qvg.codecs.qvg.format import pack_codes, unpack_codes


def test_dense_round_trip_is_exact_and_counts_bytes():
    x = torch.randn(2, 7, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    packed = dq.quantize(x, "bf16")
    assert torch.equal(dq.dequantize(packed), x)
    assert packed.nbytes == x.numel() * 8


@pytest.mark.parametrize(
    "config",
    [dq.QVGConfig(), dq.QVGConfig(bits=4), dq.QVGConfig(packing="bits"), dq.QVGConfig(symmetric=False, group_size=8)],
)
def test_code_packing_round_trips(config):
    g = torch.Generator().manual_seed(1)
    levels = 3 if config.trits else 2**config.bits
    u = torch.randint(0, levels, (4, 5, 2, config.group_size), generator=g)
    packed = pack_codes(u, config)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 2 * config.group_code_bytes
    assert torch.equal(unpack_codes(packed, config), u.to(torch.int32))


def test_trits_cost_1_625_bits_per_code_in_groups_of_64():
    assert dq.QVGConfig().group_code_bytes == 13
    assert dq.QVGConfig(packing="bits").group_code_bytes == 16


@pytest.mark.parametrize(
    "rows, message",
    [
        ([(0, 0, 0, 0)], "length >= 1"),
        ([(0, 4, 0, 0), (-1, 2, 0, 0)], "non-negative"),
        ([(0, 4, 0, -1)], "non-negative"),
        ([(0, 4, 2**31 - 2, 0)], "int32"),
        ([(0, 4, 0)], "src_start, length, dst_start, slot"),
    ],
)
def test_segment_rows_are_checked_when_the_table_is_built(rows, message):
    with pytest.raises(ValueError, match=message):
        dq.segment_table(rows)


def test_segment_table_holds_host_rows_and_their_int32_tensor():
    table = dq.segment_table([[3, 4, 0, 1], (0, 3, 4, 0)])
    assert table.rows == ((3, 4, 0, 1), (0, 3, 4, 0)) and len(table) == 2
    assert (table.src_end, table.dst_end, table.slot_end) == (7, 7, 2)
    assert table.tensor.dtype == torch.int32 and table.tensor.tolist() == [[3, 4, 0, 1], [0, 3, 4, 0]]
    assert len(dq.segment_table([])) == 0 and dq.segment_table([]).tensor.shape == (0, 4)
    with pytest.raises(ValueError, match="int32 \\[2, 4\\]"):
        dq.SegmentTable(table.rows, table.tensor[:1])



def test_tiles_cut_the_written_tokens_into_disjoint_runs_of_the_last_row_that_writes_them():
    from diffusers_qvg.codecs.base import TILE_TOKENS

    rows = [(0, 10, 0, 0), (100, 4, 3, 1), (50, 2, 20, 2), (200, TILE_TOKENS + 5, 30, 1)]  # row 1 inside row 0; a gap
    tiles = dq.segment_table(rows).tiles.tolist()
    assert tiles == [
        [0, 0, 3, 0], [100, 3, 4, 1], [7, 7, 3, 0], [50, 20, 2, 2],
        [200, 30, TILE_TOKENS, 1], [200 + TILE_TOKENS, 30 + TILE_TOKENS, 5, 1],
    ]  # (src_start, dst_start, tokens, slot), by destination; tokens 10..19 are nobody's
    # Every written token once, from the last row naming it: the reference decoders' in-order copies.
    owner = {}
    for i, (src, n, dst, _) in enumerate(rows):
        owner.update({dst + k: (i, src + k) for k in range(n)})
    from_tiles = {d + k: s + k for s, d, n, _ in tiles for k in range(n)}
    assert from_tiles == {d: src for d, (_, src) in owner.items()}
    assert dq.SegmentTable(((0, 2, 0, 0),), torch.tensor([[0, 2, 0, 0]], dtype=torch.int32)).tiles.tolist() == [[0, 0, 2, 0]]
    assert dq.segment_table([]).tiles.shape == (0, 4)

BAD_TABLES = [
    (dq.segment_table([(0, 4, 0, 0), (4, 5, 4, 1)]), ValueError, "past the storage capacity 8"),
    (dq.segment_table([(0, 4, 0, 0), (4, 4, 7, 1)]), ValueError, "past the workspace length 10"),
    (dq.segment_table([(0, 4, 0, 2)]), ValueError, "slot 2, outside \\[0, 2\\)"),
    (torch.tensor([[0, 4, 0, 0]], dtype=torch.int32), TypeError, "SegmentTable"),
]


@pytest.mark.parametrize(
    "config", [dq.BF16Config(), dq.QVGConfig(num_centroids=2), dq.KIVIConfig(key_group_tokens=4), dq.NVFP4Config()],
    ids=["bf16", "qvg", "kivi", "nvfp4"],
)
@pytest.mark.parametrize("table, error, message", BAD_TABLES)
def test_bad_segment_tables_raise_before_the_workspace_is_written(config, table, error, message):
    storage = config.allocate(batch=1, capacity_tokens=8, heads=1, head_dim=64, num_slots=2, dtype=torch.float32, device="cpu")
    for slot in range(2):
        x = torch.randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(slot))
        config.quantize_into(storage, x, token_start=4 * slot, slot=slot)
    out = torch.full((1, 10, 1, 64), 7.0)
    with pytest.raises(error, match=message):
        config.dequantize_into(storage, table, out)
    assert (out == 7.0).all()


@pytest.mark.parametrize(
    "config", [dq.BF16Config(), dq.QVGConfig(num_centroids=2), dq.KIVIConfig(), dq.NVFP4Config()], ids=["bf16", "qvg", "kivi", "nvfp4"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "nan-beside-huge"])
def test_nan_and_inf_are_found_anywhere_by_the_one_reduction(config, dtype, bad):
    x = torch.randn(1, 8, 2, 64, generator=torch.Generator().manual_seed(0), dtype=dtype)
    storage = config.allocate(batch=1, capacity_tokens=8, heads=2, head_dim=64, num_slots=1, dtype=dtype, device="cpu")
    before = {k: v.clone() for k, v in storage.tensors().items()}
    for index in [(0, 0, 0, 0), (0, 5, 1, 33), (0, 7, 1, 63)]:
        y = x.clone()
        y[index] = float(bad.split("-beside")[0])
        if bad == "nan-beside-huge":
            y[0, 1, 0, 0] = 1e30  # NaN wins over a too-large value: the message names the real problem
        with pytest.raises(ValueError, match="NaN or Inf"):
            config.quantize_into(storage, y, token_start=0, slot=0)
    for key, tensor in storage.tensors().items():
        assert torch.equal(tensor.view(torch.uint8), before[key].view(torch.uint8)), key


def test_the_magnitude_limit_is_per_codec_and_counts_negative_values():
    x = torch.randn(1, 8, 1, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[0, 3, 0, 5] = -1e20
    with pytest.raises(ValueError, match="up to 1e\\+20; qvg stores magnitudes up to 2\\^50"):
        dq.quantize(x, dq.QVGConfig(num_centroids=2))
    with pytest.raises(ValueError, match="kivi stores magnitudes up to 2\\^50"):
        dq.quantize(x, "kivi-int2")
    with pytest.raises(ValueError, match="nvfp4 stores magnitudes up to 2\\^50"):
        dq.quantize(x, "nvfp4")
    x[0, 3, 0, 5] = -1e300  # finite: the unquantized format stores it as it is
    assert torch.equal(dq.dequantize(dq.quantize(x, "bf16")), x)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="qvg-int2"):
        dq.quantize(torch.zeros(1, 4, 1, 8), "int3")
