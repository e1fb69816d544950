import pytest

from diffusers_qvg.pipelines import QVGCausalWanPipeline, tiny_components


@pytest.fixture(scope="module")
def pipe():
    """The tiny causal Wan pipeline with seeded random weights (CPU, float32)."""
    pipe = QVGCausalWanPipeline(**tiny_components(seed=0))
    pipe.set_progress_bar_config(disable=True)
    return pipe
