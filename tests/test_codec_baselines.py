"""RTN and KIVI baselines on small hand-checked cases, through the same interface as QVG."""

import pytest
import torch

import diffusers_qvg as dq


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_presets_resolve_to_the_baselines():
    assert dq.resolve_codec("rtn-int2") == dq.QVGConfig.rtn()
    assert dq.resolve_codec("rtn-int2-asym") == dq.QVGConfig.rtn(symmetric=False)
    assert dq.resolve_codec("kivi-int2") == dq.KIVIConfig()
    assert dq.resolve_codec("qvg-int2-official") == dq.QVGConfig.official()
    assert dq.QVGConfig.rtn().stages == 0 and dq.QVGConfig.rtn().scale_search == "absmax"


def test_rtn_int4_symmetric_by_hand():
    # One group of 4: absmax 7 -> step 1 exactly (fp16 scale 2^15 under the shift 2^-15); -3.5 rounds to even.
    x = torch.tensor([7.0, -3.5, 1.0, 0.0]).view(1, 1, 1, 4)
    packed = dq.quantize(x, dq.QVGConfig.rtn(bits=4, group_size=4))
    assert packed.scale_shift.item() == 2.0**-15 and packed.scales.float().item() == 2.0**15
    assert dq.dequantize(packed).flatten().tolist() == [7.0, -4.0, 1.0, 0.0]
    assert packed.codes.flatten().tolist() == [14 << 4 | 3, 8 << 4 | 7]  # u = q + 7, two per byte, MSB first


def test_rtn_int2_asymmetric_by_hand():
    # min 1, max 4 -> zero 1, step 1: every value of {1, 2, 3, 4} is a level, so the round trip is exact.
    x = torch.tensor([4.0, 1.0, 2.0, 3.0, -2.0, -2.0, 0.0, 1.0]).view(1, 1, 1, 8)
    packed = dq.quantize(x, dq.QVGConfig.rtn(symmetric=False, group_size=4))
    assert torch.equal(dq.dequantize(packed), x)
    assert packed.codes.flatten().tolist() == [3 << 6 | 0 << 4 | 1 << 2 | 2, 0 << 6 | 0 << 4 | 2 << 2 | 3]


def test_rtn_costs_its_bits_exactly():
    storage = dq.QVGConfig.rtn().allocate(
        batch=1, capacity_tokens=4680, heads=12, head_dim=128, num_slots=1, dtype=torch.bfloat16, device="cpu"
    )
    assert storage.bits_per_element() == pytest.approx(2 + 16 / 64 + 32 / (4680 * 128), rel=1e-12)


def test_kivi_values_by_hand():
    # Per token, per group of 4 channels: [0, 1, 2, 3] and [10, 10.5, 11, 11.5] sit on a 4-level grid.
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0, 10.5, 11.0, 11.5]).view(1, 1, 1, 8)
    config = dq.KIVIConfig(group_size=4)
    packed = dq.quantize(x, config, role="value")
    assert packed.scales.shape == (1, 1, 1, 2) and packed.scales.dtype == torch.float16
    assert torch.equal(dq.dequantize(packed), x)


def test_kivi_keys_are_grouped_per_channel_over_tokens():
    # Channel c holds c * t at token t: exactly representable per channel, not per token.
    t = torch.arange(4.0)
    x = (t[:, None] * torch.tensor([1.0, 3.0, -2.0, 0.5])).view(1, 4, 1, 4)
    config = dq.KIVIConfig(group_size=4, key_group_tokens=4)
    keys = dq.quantize(x, config, role="key")
    assert keys.scales.shape == (1, 1, 1, 4)
    assert torch.equal(dq.dequantize(keys), x)
    assert not torch.equal(dq.dequantize(dq.quantize(x, config, role="value")), x)


def test_kivi_keys_handle_outlier_channels_better_than_per_token_groups():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 80, 2, 32, generator=g)
    x[..., 3] += 40  # an outlier channel, as keys have
    config = dq.KIVIConfig()
    key_err = rel_l2(dq.dequantize(dq.quantize(x, config, role="key")), x)
    value_err = rel_l2(dq.dequantize(dq.quantize(x, config, role="value")), x)
    assert key_err < 0.5 * value_err


def test_kivi_partial_last_key_group_and_segments():
    g = torch.Generator().manual_seed(1)
    config = dq.KIVIConfig(key_group_tokens=8)
    a, b = torch.randn(2, 16, 3, 32, generator=g), torch.randn(2, 13, 3, 32, generator=g)
    storage = config.allocate(batch=2, capacity_tokens=29, heads=3, head_dim=32, num_slots=2, dtype=torch.float32, device="cpu", role="key")
    assert storage.scales.shape == (2, 4, 3, 32)  # ceil(29 / 8) token groups per channel
    config.quantize_into(storage, a, token_start=0, slot=0, role="key")
    config.quantize_into(storage, b, token_start=16, slot=1, role="key")
    out = torch.empty(2, 29, 3, 32)
    config.dequantize_into(storage, dq.segment_table([(16, 13, 0, 1), (0, 16, 13, 0)]), out)
    assert torch.equal(out[:, :13], dq.dequantize(dq.quantize(b, config, role="key")))
    assert torch.equal(out[:, 13:], dq.dequantize(dq.quantize(a, config, role="key")))
    assert storage.nbytes == sum(t.numel() * t.element_size() for t in storage.tensors().values())
    # codes 8 bytes per token-head; fp16 scale + zero per (token group, channel); float32 shift per slot-head.
    assert storage.nbytes == 2 * 29 * 3 * 8 + 2 * 4 * 3 * 32 * 4 + 2 * 2 * 3 * 4


@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_round_trip_shapes_and_extreme_magnitudes(role, dtype, bits):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 50, 3, 64, generator=g)
    config = dq.KIVIConfig(bits=bits)
    extreme = 12 if dtype == torch.float16 else 40  # float16 itself stops near 2^-14 (normal) and 2^16
    for scale in (1.0, 2.0**-extreme, 2.0 ** (extreme // 2)):
        scaled = (x * scale).to(dtype)
        x_hat = dq.dequantize(dq.quantize(scaled, config, role=role))
        assert x_hat.shape == x.shape and x_hat.dtype == dtype and torch.isfinite(x_hat).all()
        assert rel_l2(x_hat, scaled) < (0.1 if bits == 4 else 0.45)


def test_kivi_bad_calls_raise_and_leave_the_storage_unchanged():
    config = dq.KIVIConfig(key_group_tokens=8)
    x = torch.randn(1, 16, 2, 32)
    storage = dq.quantize(x, config, role="key")
    before = {k: v.clone() for k, v in storage.tensors().items()}
    with pytest.raises(ValueError, match="allocated for keys"):
        config.quantize_into(storage, x[:, :8], token_start=0, slot=0, role="value")
    with pytest.raises(ValueError, match="multiple of key_group_tokens=8"):
        config.quantize_into(storage, x[:, :8], token_start=4, slot=0, role="key")
    with pytest.raises(ValueError, match="2\\^50"):
        config.quantize_into(storage, x * 1e20, token_start=0, slot=0, role="key")
    with pytest.raises(ValueError, match="NaN or Inf"):
        config.quantize_into(storage, x.clone().fill_(float("nan")), token_start=0, slot=0, role="key")
    with pytest.raises(ValueError, match="group_size"):
        dq.quantize(torch.randn(1, 4, 1, 20), config)
    for key, tensor in storage.tensors().items():
        assert torch.equal(tensor, before[key]), key


@pytest.mark.parametrize("field, value", [("bits", 3), ("group_size", 0), ("key_group_tokens", -8)])
def test_kivi_bad_config_fields_are_named(field, value):
    with pytest.raises(ValueError, match=f"KIVIConfig.{field}"):
        dq.KIVIConfig(**{field: value})


def test_kivi_role_must_be_key_or_value():
    with pytest.raises(ValueError, match="role must be"):
        dq.quantize(torch.randn(1, 4, 1, 32), "kivi-int2", role="query")
