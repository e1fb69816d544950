"""Original-layout (Self-Forcing / CausVid) checkpoints -> WanTransformer3DModel, and the base-folder load."""

import numpy as np
import pytest
import torch
from diffusers import FlowMatchLCMScheduler, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

from diffusers_qvg.pipelines import (
    CheckpointKeyError,
    QVGCausalWanPipeline,
    convert_wan_original_to_diffusers,
    load_causal_wan_transformer,
    randomize_,
    tiny_components,
)
from diffusers_qvg.pipelines.random_models import TINY_TRANSFORMER_CONFIG

# The original Wan names (wan/modules/model.py) of every diffusers parameter, written out key by key.
TOP = {
    "patch_embedding.weight": "patch_embedding.weight",
    "patch_embedding.bias": "patch_embedding.bias",
    "text_embedding.0.weight": "condition_embedder.text_embedder.linear_1.weight",
    "text_embedding.0.bias": "condition_embedder.text_embedder.linear_1.bias",
    "text_embedding.2.weight": "condition_embedder.text_embedder.linear_2.weight",
    "text_embedding.2.bias": "condition_embedder.text_embedder.linear_2.bias",
    "time_embedding.0.weight": "condition_embedder.time_embedder.linear_1.weight",
    "time_embedding.0.bias": "condition_embedder.time_embedder.linear_1.bias",
    "time_embedding.2.weight": "condition_embedder.time_embedder.linear_2.weight",
    "time_embedding.2.bias": "condition_embedder.time_embedder.linear_2.bias",
    "time_projection.1.weight": "condition_embedder.time_proj.weight",
    "time_projection.1.bias": "condition_embedder.time_proj.bias",
    "head.head.weight": "proj_out.weight",
    "head.head.bias": "proj_out.bias",
    "head.modulation": "scale_shift_table",
}
BLOCK = {
    "modulation": "scale_shift_table",
    "norm3.weight": "norm2.weight",
    "norm3.bias": "norm2.bias",
    "ffn.0.weight": "ffn.net.0.proj.weight",
    "ffn.0.bias": "ffn.net.0.proj.bias",
    "ffn.2.weight": "ffn.net.2.weight",
    "ffn.2.bias": "ffn.net.2.bias",
}
for orig, new in (("self_attn", "attn1"), ("cross_attn", "attn2")):
    for o, n in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0")):
        BLOCK[f"{orig}.{o}.weight"] = f"{new}.{n}.weight"
        BLOCK[f"{orig}.{o}.bias"] = f"{new}.{n}.bias"
    BLOCK[f"{orig}.norm_q.weight"] = f"{new}.norm_q.weight"
    BLOCK[f"{orig}.norm_k.weight"] = f"{new}.norm_k.weight"


def original_layout(model: WanTransformer3DModel) -> dict[str, torch.Tensor]:
    """The state dict as Self-Forcing saves it: original names under the wrapper's ``model.`` prefix."""
    ours = model.state_dict()
    names = dict(TOP)
    for i in range(len(model.blocks)):
        names.update({f"blocks.{i}.{o}": f"blocks.{i}.{n}" for o, n in BLOCK.items()})
    assert sorted(names.values()) == sorted(ours), "the test's table must cover the model exactly"
    return {f"model.{orig}": ours[new].clone() for orig, new in names.items()}


@pytest.fixture(scope="module")
def source():
    return randomize_(WanTransformer3DModel(**TINY_TRANSFORMER_CONFIG), seed=11, std=0.1).eval()


@pytest.fixture()
def checkpoint(tmp_path, source):
    path = tmp_path / "self_forcing_dmd.pt"
    torch.save({"generator_ema": original_layout(source), "generator": {}, "critic": {}}, path)
    return path


def forward(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 3, 4, 4, generator=g)
    text = torch.randn(1, 7, TINY_TRANSFORMER_CONFIG["text_dim"], generator=g)
    with torch.no_grad():
        return model(hidden_states=x, timestep=torch.tensor([937.5]), encoder_hidden_states=text, return_dict=False)[0]


def test_conversion_round_trip(checkpoint, source):
    loaded = load_causal_wan_transformer(checkpoint, dict(source.config), upstream_numerics=False)
    expected = source.state_dict()
    got = loaded.state_dict()
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert torch.equal(forward(loaded), forward(source))


def test_training_wrapper_prefixes_are_stripped(source):
    wrapped = {k.replace("model.", "model._fsdp_wrapped_module.", 1): v for k, v in original_layout(source).items()}
    assert sorted(convert_wan_original_to_diffusers(wrapped)) == sorted(source.state_dict())


def test_loads_from_a_base_folder_config_and_casts(tmp_path, checkpoint, source):
    source.save_pretrained(tmp_path / "base" / "transformer")
    loaded = load_causal_wan_transformer(checkpoint, tmp_path / "base", torch_dtype=torch.bfloat16)
    assert torch.equal(loaded.blocks[1].attn1.to_q.weight, source.blocks[1].attn1.to_q.weight.bfloat16())
    # like from_pretrained(torch_dtype=...): diffusers' fp32 modules stay fp32
    assert loaded.blocks[1].scale_shift_table.dtype == torch.float32
    assert loaded.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32


def test_missing_and_unexpected_keys_are_listed(tmp_path, source):
    state = original_layout(source)
    del state["model.blocks.1.self_attn.k.weight"]
    state["model.blocks.1.self_attn.extra.weight"] = torch.zeros(1)
    path = tmp_path / "broken.pt"
    torch.save({"generator": state}, path)
    with pytest.raises(CheckpointKeyError) as info:
        load_causal_wan_transformer(path, dict(source.config))
    message = str(info.value)
    assert "missing keys (1): blocks.1.attn1.to_k.weight" in message
    assert "unexpected keys (1): blocks.1.self_attn.extra.weight" in message


def test_wrong_size_model_reports_shapes(checkpoint, source):
    bigger = dict(source.config, ffn_dim=96)
    with pytest.raises(CheckpointKeyError, match=r"blocks.0.ffn.net.0.proj.weight: checkpoint \(64, 128\) vs model \(96, 128\)"):
        load_causal_wan_transformer(checkpoint, bigger)


def test_file_without_a_generator_is_refused(tmp_path, source):
    path = tmp_path / "optimizer.pt"
    torch.save({"optimizer": {"step": 3}, "step": 3}, path)
    with pytest.raises(CheckpointKeyError, match=r"no generator state dict.*found top-level entries \['optimizer', 'step'\]"):
        load_causal_wan_transformer(path, dict(source.config))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_causal_wan_transformer(tmp_path / "nope.pt", dict(source.config))


def test_from_pretrained_on_a_wan_base_folder(tmp_path, checkpoint, source):
    components = tiny_components(seed=1)
    components["scheduler"] = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                      flow_shift=3.0)
    WanPipeline(**components).save_pretrained(tmp_path / "base")
    transformer = load_causal_wan_transformer(checkpoint, tmp_path / "base")
    pipe = QVGCausalWanPipeline.from_pretrained(tmp_path / "base", transformer=transformer)
    assert isinstance(pipe.scheduler, FlowMatchLCMScheduler) and pipe.scheduler.config.shift == 5.0
    assert pipe.transformer is transformer
    pipe.set_progress_bar_config(disable=True)
    video = pipe("a boat", height=32, width=32, num_frames=9, kv_cache="bf16").frames
    assert video.shape == (1, 9, 32, 32, 3) and np.isfinite(video).all()
    # A folder saved by this pipeline keeps its own scheduler.
    pipe.save_pretrained(tmp_path / "ours")
    assert isinstance(QVGCausalWanPipeline.from_pretrained(tmp_path / "ours").scheduler, FlowMatchLCMScheduler)
