"""NVFP4, LongLive-2's KV cache format: torchao's NVFP4 bytes, four-over-six scales, the codec contract."""

import pytest
import torch

import diffusers_qvg as dq
from diffusers_qvg.codecs.nvfp4 import E2M1_GRID, e2m1_codes, e2m1_values
from diffusers_qvg.rotary import rotate


def nearest_e2m1(y: torch.Tensor) -> torch.Tensor:
    """The e2m1 code of each value by brute force: the nearest grid magnitude in float64, the even code on a
    tie, the sign bit from ``signbit`` (so -0.2 is -0)."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    distance = (y.double().abs()[:, None] - grid[None, :]).abs()
    nearest = distance.min(dim=1, keepdim=True).values
    tied = distance == nearest  # one or two neighbours
    even_first = torch.where(tied & (torch.arange(8) % 2 == 0), 0, 1) * 8 + torch.arange(8)
    index = torch.where(tied, even_first, 99).argmin(dim=1)
    return (index | (torch.signbit(y).long() << 3)).to(torch.uint8)


def round_trip(config, x, **table):
    B, N, H, D = x.shape
    storage = config.allocate(batch=B, capacity_tokens=N, heads=H, head_dim=D, num_slots=1, dtype=x.dtype, device="cpu")
    config.quantize_into(storage, x, token_start=0, slot=0)
    out = torch.zeros_like(x)
    config.dequantize_into(storage, dq.segment_table([(0, N, 0, 0)]), out, **table)
    return out, storage


def test_e2m1_rounding_is_nearest_even_ties_and_signed_zeros_included():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    y = torch.cat([torch.linspace(-6, 6, 48_001), ties, -ties, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 6.0, -6.0])])
    codes = e2m1_codes(y)
    assert torch.equal(codes, nearest_e2m1(y))
    assert codes[48_001:48_008].tolist() == [0, 2, 2, 4, 4, 6, 6]  # 0.25 -> 0, 0.75 -> 1, ..., 5 -> 4
    assert codes[-6:].tolist() == [0, 8, 0, 8, 7, 15]  # a negative value rounding to 0 keeps its sign
    assert e2m1_values(torch.arange(16, dtype=torch.uint8), torch.float32).abs().tolist() == list(E2M1_GRID) * 2


def test_static_6_by_hand():
    # The head's largest |x| is 6, so the second level is 6 / (6 * 448); block 0's largest is 3: scale
    # e4m3(3 / 6 * 448) = 224 (exact), and the values are scaled by 448 / 224 = 2 before rounding; block 1's
    # largest 6: scale 448, values unscaled; 5.2 rounds to 6 and 2.6 to 3.
    x = torch.zeros(1, 1, 1, 32)
    x[0, 0, 0, :4] = torch.tensor([3.0, 1.1, -0.2, -0.26])
    x[0, 0, 0, 16:19] = torch.tensor([-6.0, 5.2, 2.6])
    codes, scales, tensor_scale = dq.NVFP4Config(scale_rule="static-6").encode(x)
    assert torch.equal(tensor_scale, torch.tensor([[6 / (6 * 448)]]))  # float32, as stored
    assert scales.float().flatten().tolist() == [224.0, 448.0]
    low, high = codes[0, 0, 0] & 0xF, codes[0, 0, 0] >> 4
    values = e2m1_values(torch.stack([low, high], -1).flatten(), torch.float32).tolist()
    assert values[:4] == [6.0, 2.0, -0.5, -0.5] and values[4:16] == [0.0] * 12  # 2.2 -> 2, -0.4 -> -0.5, -0.52 -> -0.5
    assert values[16:19] == [-6.0, 6.0, 3.0] and values[19:] == [0.0] * 13


def test_four_over_six_keeps_the_scale_with_the_smaller_error_in_each_block():
    # Block 0 is e2m1 values over 4 (largest 1), block 1 e2m1 values (largest 6, the tensor's): with the second
    # level 6 / (6 * 256), block 0's scale mapping 1 to 4 (64) and block 1's mapping 6 to 6 (256) are exact in
    # e4m3 and store their blocks exactly; the other candidates (44 after rounding, 384) do not.
    fours = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -4.0, 3.0, -2.0, 1.0, 0.0, 0.5, -1.5, 2.0, 4.0]) / 4
    sixes = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID))
    x = torch.cat([fours, sixes]).view(1, 1, 1, 32)
    exact, _ = round_trip(dq.NVFP4Config(), x)
    assert torch.equal(exact, x)
    static, _ = round_trip(dq.NVFP4Config(scale_rule="static-6"), x)
    assert not torch.equal(static[..., :16], x[..., :16])  # mapped to 6, 0.75 and 0.375 are off the grid
    assert torch.equal(static[..., 16:], x[..., 16:])


def test_four_over_six_has_less_error_than_plain_nvfp4_on_average():
    x = torch.randn(1, 256, 4, 128, generator=torch.Generator().manual_seed(1))
    errors = {rule: (round_trip(dq.NVFP4Config(scale_rule=rule), x)[0] - x).norm() / x.norm() for rule in ("static-6", "four-over-six")}
    assert 0.05 < errors["four-over-six"] < errors["static-6"] < 0.12, errors


@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 1e12])
def test_the_per_head_scale_keeps_tiny_and_huge_tensors_as_accurate_as_unit_ones(magnitude):
    x = torch.randn(1, 64, 2, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out, storage = round_trip(dq.NVFP4Config(), x * magnitude)
    unit, _ = round_trip(dq.NVFP4Config(), x)
    torch.testing.assert_close(out / magnitude, unit, rtol=1e-6, atol=0)
    assert storage.bits_per_element() == pytest.approx(4.5 + 32 / (64 * 32))


def test_zeros_store_and_decode_as_zeros():
    out, storage = round_trip(dq.NVFP4Config(), torch.zeros(1, 8, 2, 16))
    assert torch.equal(out, torch.zeros_like(out)) and (storage.tensor_scale == 1).all()


def test_a_head_packs_to_the_same_bytes_alone_as_beside_its_neighbours():
    x = torch.randn(1, 32, 4, 64, generator=torch.Generator().manual_seed(3))
    x[:, :, 0] *= 100  # a loud head would coarsen its neighbours under one scale over all heads
    codes, scales, tensor_scale = dq.NVFP4Config().encode(x)
    part_codes, part_scales, part_tensor_scale = dq.NVFP4Config().encode(x[:, :, 1:3])
    assert torch.equal(codes[:, :, 1:3], part_codes)
    assert torch.equal(scales[:, :, 1:3].view(torch.uint8), part_scales.view(torch.uint8))
    assert torch.equal(tensor_scale[:, 1:3], part_tensor_scale)


def test_segments_land_at_their_offsets_and_keys_rotate_after_decoding():
    config = dq.NVFP4Config()
    g = torch.Generator().manual_seed(4)
    storage = config.allocate(batch=1, capacity_tokens=32, heads=2, head_dim=32, num_slots=2, dtype=torch.float64, device="cpu")
    chunks = [torch.randn(1, 16, 2, 32, generator=g, dtype=torch.float64) for _ in range(2)]
    for slot, chunk in enumerate(chunks):
        config.quantize_into(storage, chunk, token_start=16 * slot, slot=slot)
    alone = [round_trip(config, chunk)[0] for chunk in chunks]
    angles = torch.randn(1, 30, 1, 16, generator=g, dtype=torch.float64).repeat_interleave(2, dim=-1)
    rope = (angles.cos(), angles.sin())
    out = torch.full((1, 30, 2, 32), 7.0, dtype=torch.float64)
    config.dequantize_into(storage, dq.segment_table([(16, 16, 0, 1), (0, 13, 17, 0)]), out, rope)
    torch.testing.assert_close(out[:, :16], rotate(alone[1], (rope[0][:, :16], rope[1][:, :16])), rtol=0, atol=1e-12)
    assert (out[:, 16] == 7.0).all()
    torch.testing.assert_close(out[:, 17:], rotate(alone[0][:, :13], (rope[0][:, 17:], rope[1][:, 17:])), rtol=0, atol=1e-12)


def test_bad_configs_and_head_dims_are_named_before_anything_is_written():
    with pytest.raises(ValueError, match="scale_rule='mse' is invalid: use one of \\['four-over-six', 'static-6'\\]"):
        dq.NVFP4Config(scale_rule="mse")
    with pytest.raises(ValueError, match="head_dim 24 is not a multiple of NVFP4's 16-channel blocks"):
        dq.NVFP4Config().allocate(batch=1, capacity_tokens=4, heads=1, head_dim=24, num_slots=1, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="head_dim 24 is not a multiple"):
        dq.quantize(torch.zeros(1, 4, 1, 24), "nvfp4")


def test_the_preset_is_longlive_2_s_rule_and_costs_4_5_bits():
    config = dq.resolve_codec("nvfp4")
    assert config == dq.NVFP4Config(scale_rule="four-over-six")
    packed = dq.quantize(torch.randn(1, 4680, 2, 128, generator=torch.Generator().manual_seed(5)), "nvfp4")
    assert packed.bits_per_element() == pytest.approx(4.5 + 32 / (4680 * 128))
