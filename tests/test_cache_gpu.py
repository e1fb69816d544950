"""The cache on CUDA: chunked generation against the masked full forward, and a QVG-packed history."""

import pytest
import torch
from test_cache_equivalence import generate
from test_cache_quantized import attend_last_chunk, reference, rel_error
from wan_helpers import tiny_wan

import diffusers_qvg as dq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@torch.no_grad()
def test_chunked_generation_on_cuda_matches_the_masked_full_forward():
    model = tiny_wan().cuda()
    cache = dq.enable_qvg(model, "bf16", window_frames=6, sink_frames=2)
    # float64 on the GPU; float32 layer norms inside diffusers amplify last-bit differences of CUDA kernels
    assert generate(model, cache, [2, 2, 2, 2], sink_frames=2, window_frames=6, device="cuda") <= 1e-6
    assert cache.workspace.keys.is_cuda


@torch.no_grad()
def test_qvg_int2_history_on_cuda_matches_the_cpu_bound():
    out, cache = attend_last_chunk(dq.QVGConfig(num_centroids=16), device="cuda")
    assert out.is_cuda and 0 < rel_error(out.cpu(), reference()) < 0.05
