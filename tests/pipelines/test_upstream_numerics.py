"""fp32 Q/K RMS norms and the float64 timestep embedding of the original Wan code, as removable hooks."""

import math

import torch
from diffusers import WanTransformer3DModel

from diffusers_qvg.pipelines import disable_upstream_numerics, enable_upstream_numerics, randomize_
from diffusers_qvg.pipelines.random_models import TINY_TRANSFORMER_CONFIG


def model(dtype=torch.float32):
    return randomize_(WanTransformer3DModel(**TINY_TRANSFORMER_CONFIG), seed=2, std=0.1).to(dtype).eval()


def test_qk_norm_rounds_before_the_weight_like_wan_rmsnorm():
    m = enable_upstream_numerics(model(torch.bfloat16))
    norm = m.blocks[0].attn1.norm_q
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 5, norm.weight.numel(), generator=torch.Generator().manual_seed(1)).bfloat16() * 7
    xf = x.float()
    reference = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * norm.weight
    assert torch.equal(norm(x), reference)
    disable_upstream_numerics(m)
    assert torch.equal(norm(x), torch.nn.functional.rms_norm(x, (x.shape[-1],), norm.weight, 1e-6))


def test_timestep_embedding_is_float64_sinusoid():
    m = enable_upstream_numerics(model())
    proj = m.condition_embedder.timesteps_proj
    t = torch.tensor([937.5, 0.0])
    out = proj(t)
    assert out.dtype == torch.float64
    half = proj.num_channels // 2
    i, k = 37, 0
    angle = 937.5 * 10000 ** (-i / half)
    assert out[k, i].item() == math.cos(angle) and out[k, half + i].item() == math.sin(angle)
    disable_upstream_numerics(m)
    assert proj(t).dtype == torch.float32


def test_hooks_change_float32_outputs_only_by_rounding_and_install_once():
    stock, hooked = model(), enable_upstream_numerics(enable_upstream_numerics(model()))
    assert list(hooked.blocks[0].attn2.norm_k._diffusers_hook.hooks) == ["qvg_upstream_fp32_rms"]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, 3, 4, 4, generator=g)
    text = torch.randn(1, 7, TINY_TRANSFORMER_CONFIG["text_dim"], generator=g)
    args = dict(hidden_states=x, timestep=torch.tensor([625.0]), encoder_hidden_states=text, return_dict=False)
    with torch.no_grad():
        hooked_out, stock_out = hooked(**args)[0], stock(**args)[0]
    # float64 vs float32 sinusoid phases at t=625 differ by ~1e-5 rad; nothing else changes in float32.
    torch.testing.assert_close(hooked_out, stock_out, rtol=0, atol=2e-4)
    assert not torch.equal(hooked_out, stock_out)
