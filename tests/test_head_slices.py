"""A head packs to the same bytes however the heads are split (one rank's heads under Ulysses, ``HeadSlice``):
the k-means inits draw for every head of the model and keep the slice's; one process's bytes are unchanged."""

import pytest
import torch

import diffusers_qvg as dq
from diffusers_qvg.codecs.base import HeadSlice
from diffusers_qvg.codecs.kernel_backend import backend
from diffusers_qvg.codecs.qvg.kmeans import kmeans_init

B, N, H, D = 2, 24, 4, 8
HEAD_AXIS = {"centroids": 3, "centroid_scales": 3}  # the other tensors hold heads on dim 2


def pack(config, x, heads=None):
    B, N, H, D = x.shape
    storage = config.allocate(batch=B, capacity_tokens=N, heads=H, head_dim=D, num_slots=1, dtype=x.dtype,
                              device=x.device)
    config.quantize_into(storage, x, token_start=0, slot=0, heads=heads)
    return storage


def raw(t):
    return t.contiguous().view(torch.uint8)


SHARES = ((0, 2), (2, 2), (1, 1), (3, 1))  # two ranks' and four ranks' heads


@pytest.mark.parametrize(
    "init, kernels, shares",
    [pytest.param(init, "torch", SHARES, id=f"{init}-torch") for init in ("strided", "random", "kmeans++")]
    + [pytest.param("random", "triton", SHARES[2:], id="random-triton")],  # the interpreter is slow: one case
)
def test_each_head_packs_alike_alone_or_with_the_others(init, kernels, shares):
    config = dq.QVGConfig(num_centroids=4, group_size=4, kmeans_init=init, kmeans_iters=2, seed=5)
    x = torch.randn(B, N, H, D, generator=torch.Generator().manual_seed(0))
    with backend(kernels):
        whole = pack(config, x)
        assert all(torch.equal(raw(t), raw(u)) for t, u in
                   zip(whole.tensors().values(), pack(config, x, HeadSlice(0, H, H)).tensors().values()))
        for start, count in shares:
            part = pack(config, x[:, :, start : start + count].contiguous(), HeadSlice(start, count, H))
            for name, tensor in part.tensors().items():
                expected = whole.tensors()[name].narrow(HEAD_AXIS.get(name, 2), start, count)
                assert torch.equal(raw(tensor), raw(expected)), (start, name)


def test_one_process_draws_are_the_unsliced_draws():
    """``heads=None`` and the full slice draw the same numbers (a generator's stream ignores the shape)."""
    x = torch.randn(B * H, N, D, generator=torch.Generator().manual_seed(1))
    for init in ("random", "kmeans++"):
        a = kmeans_init(x, 6, init, torch.Generator().manual_seed(2))
        b = kmeans_init(x, 6, init, torch.Generator().manual_seed(2), HeadSlice(0, H, H))
        assert torch.equal(a, b)


def test_a_slice_that_does_not_match_the_tensor_is_named():
    config = dq.QVGConfig(num_centroids=4, group_size=4)
    x = torch.randn(1, N, 2, D)
    with pytest.raises(ValueError, match=r"x holds 2 heads but heads=HeadSlice\(start=0, count=3, total=4\)"):
        pack(config, x, HeadSlice(0, 3, 4))
    with pytest.raises(ValueError, match="heads \\[3, 5\\) of 4"):
        pack(config, x, HeadSlice(3, 2, 4))
