"""The error measures: hand-checked values and exact zeros where nothing changed."""

import math

import pytest
import torch

from diffusers_qvg.metrics import attention, rel_l2


def test_rel_l2_by_hand():
    ref = torch.tensor([3.0, 4.0])
    assert rel_l2(ref, ref) == 0.0
    assert rel_l2(ref, torch.tensor([3.0, 5.0])) == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="shapes differ"):
        rel_l2(ref, torch.zeros(3))


def test_attention_matches_the_softmax_formula():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 4, generator=g, dtype=torch.float64) for n in (3, 5, 5))
    weights = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(4), dim=-1)
    expected = torch.einsum("bhqk,bkhd->bqhd", weights, v)
    torch.testing.assert_close(attention(q, k, v), expected.float(), rtol=1e-5, atol=1e-6)
