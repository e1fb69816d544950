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


def test_segment_rows_are_checked():
    with pytest.raises(ValueError, match="length >= 1"):
        dq.segment_table([(0, 0, 0, 0)])


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="qvg-int2"):
        dq.quantize(torch.zeros(1, 4, 1, 8), "int3")
