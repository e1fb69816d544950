"""The tiny pipeline on CUDA in bfloat16 with a QVG-packed cache (skipped without CUDA)."""

import numpy as np
import pytest
import torch

from diffusers_qvg.pipelines import QVGCausalWanPipeline, cast_keeping_fp32_modules, tiny_components

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_bf16_pipeline_on_cuda_streams_the_frames_of_call():
    components = tiny_components(seed=0)
    cast_keeping_fp32_modules(components["transformer"], torch.bfloat16)
    pipe = QVGCausalWanPipeline(**components).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt="a red fox", height=160, width=160, num_frames=45, kv_cache="qvg-int2")
    video = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    with pipe.stream(**kwargs, generator=torch.Generator().manual_seed(0)) as state:
        chunks = list(state)
        report = state.cache.memory_report()
    assert video.shape == (1, 45, 160, 160, 3) and np.isfinite(video).all()
    assert np.array_equal(np.concatenate(chunks, axis=1), video)
    assert report.packed > 0
