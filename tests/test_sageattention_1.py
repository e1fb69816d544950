"""SageAttention 1.0.6's kernels as the benchmarks call them (interpreted here): attention, inputs untouched."""

import pytest
import torch

from diffusers_qvg.codecs import kernel_backend
from diffusers_qvg.metrics import attention
from diffusers_qvg.sageattention_1 import sageattention_1


def _qkv(tokens: int, queries: int, dim: int):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, n, 2, dim, generator=g).to(torch.bfloat16) for n in (queries, tokens, tokens))
    return q, k + 2.0, v  # a common key offset: what the smoothing takes off


def test_it_is_attention_within_its_int8_error_and_leaves_the_inputs_unchanged():
    """The mean comes off K out of place: ``sageattn`` itself would rewrite a cache attending to its storage."""
    q, k, v = _qkv(tokens=256, queries=130, dim=64)  # a short last query block
    before = [t.clone() for t in (q, k, v)]
    out = sageattention_1(q, k, v)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = attention(q, k, v)
    assert 1e-3 < ((out.float() - ref).norm() / ref.norm()).item() < 0.05  # int8 Q K: not exact, not far
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))


def test_a_strided_query_gives_what_a_contiguous_one_does():
    q, k, v = _qkv(tokens=128, queries=128, dim=64)
    wide = torch.cat([q, q], dim=-1)[..., :64]  # head_dim not contiguous
    assert wide.stride(-1) == 1 and not wide.is_contiguous()
    assert torch.equal(sageattention_1(wide, k, v), sageattention_1(q, k, v))
    head_major = q.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)  # head_dim strided: copied first
    assert head_major.stride(-1) == 2 and torch.equal(sageattention_1(head_major, k, v), sageattention_1(q, k, v))


@pytest.mark.parametrize("dims", [(96, 96, 96), (32, 32, 32), (64, 64, 128)])
def test_a_head_dim_its_kernels_do_not_run_is_refused_by_name(dims):
    q, k, v = (torch.zeros(1, 4, 1, d, dtype=torch.bfloat16) for d in dims)
    with pytest.raises(ValueError, match="head_dim 64 or 128"):
        sageattention_1(q, k, v)


def test_a_cpu_tensor_without_the_interpreter_is_refused_by_name(monkeypatch):
    """Triton's own error off CUDA ("0 active drivers") names neither the cause nor the fix."""
    monkeypatch.setattr(kernel_backend, "INTERPRETING", False)
    q, k, v = _qkv(tokens=128, queries=128, dim=64)
    with pytest.raises(ValueError, match="SageAttention's Triton kernels need CUDA tensors .*TRITON_INTERPRET=1"):
        sageattention_1(q, k, v)


def test_operands_on_two_devices_are_refused_by_name():
    q, k, v = _qkv(tokens=128, queries=128, dim=64)
    with pytest.raises(ValueError, match="one device.*'cpu', 'meta'"):
        sageattention_1(q, k.to("meta"), v)
