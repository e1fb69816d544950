"""The diffusers habit: one processor for every layer, ``transformer.set_attn_processor(QVGWanAttnProcessor(cache))``.

A cache made without a layer count finds its layers as their modules call it (in order, during the first
chunk); ``diffusers_qvg.attach_cache(transformer, cache)`` adds the RoPE frame offset that ``enable_qvg``
installs. The result is bit-identical to ``enable_qvg``'s; what is missing is named with its one-line fix.
"""

import pytest
import torch
from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2AttnProcessor
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from wan_helpers import HEIGHT, WIDTH, tiny_skyreels_v2, tiny_wan

import diffusers_qvg as dq

TEXT = torch.randn(1, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
STORAGES = {"bf16": "bf16", "qvg-int2": dq.QVGConfig(num_centroids=4, group_size=4)}
OPTIONS = dict(commit="final-pass", window_frames=6)


def stream(model, cache, chunks=3, frames=2):
    """Two denoising forwards and a clean-context pass per chunk; every output."""
    g = torch.Generator().manual_seed(0)
    outs = []
    for c in range(chunks):
        for t in (500.0, 250.0, 0.0):
            x = torch.randn(1, 16, frames, HEIGHT, WIDTH, dtype=torch.float64, generator=g)
            with cache.chunk(start_frame=frames * c, final=t == 0.0):
                outs.append(model(x, torch.tensor([t], dtype=torch.float64), TEXT).sample)
    return outs


def stored(cache):
    return [t for layer in cache.layers for s in layer.storages() for t in s.tensors().values()]


def assert_identical(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def shared_setup(model, storage, as_dict=False, processor_cls=dq.QVGWanAttnProcessor):
    cache = dq.QVGCache(dq.CacheConfig(storage=storage, **OPTIONS))
    processor = processor_cls(cache)
    if as_dict:  # the other form set_attn_processor takes: cached self-attention, the rest as it was
        processors = {name: processor if ".attn1." in name else p for name, p in model.attn_processors.items()}
        model.set_attn_processor(processors)
    else:
        model.set_attn_processor(processor)
    dq.attach_cache(model, cache)
    return cache


@torch.no_grad()
@pytest.mark.parametrize("name", STORAGES)
@pytest.mark.parametrize("as_dict", [False, True], ids=["one-processor", "dict"])
def test_one_shared_processor_is_bit_identical_to_enable_qvg(name, as_dict):
    reference, shared = tiny_wan(), tiny_wan()
    expected_cache = dq.enable_qvg(reference, STORAGES[name], **OPTIONS)
    cache = shared_setup(shared, STORAGES[name], as_dict)
    assert cache.layers == []  # found as the modules call it
    assert_identical(stream(shared, cache), stream(reference, expected_cache))
    assert len(cache.layers) == 2 and cache.layers_fixed
    assert_identical(stored(cache), stored(expected_cache))
    assert cache.layout == expected_cache.layout


@torch.no_grad()
def test_the_skyreels_v2_processor_is_shared_the_same_way():
    reference, shared = tiny_skyreels_v2(2), tiny_skyreels_v2(2)
    expected_cache = dq.enable_qvg(reference, "bf16", **OPTIONS)
    cache = shared_setup(shared, "bf16", processor_cls=dq.QVGSkyReelsV2AttnProcessor)
    assert_identical(stream(shared, cache), stream(reference, expected_cache))


@torch.no_grad()
def test_without_the_rope_offset_the_first_forward_names_the_fix_and_changes_nothing():
    model = tiny_wan()
    cache = dq.QVGCache(dq.CacheConfig(storage="bf16", **OPTIONS))
    model.set_attn_processor(dq.QVGWanAttnProcessor(cache))
    x = torch.randn(1, 16, 2, HEIGHT, WIDTH, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"RoPE has no frame offset.*`diffusers_qvg\.attach_cache\(transformer, cache\)`"):
        with cache.chunk(start_frame=0):
            model(x, torch.tensor([500.0], dtype=torch.float64), TEXT)
    assert cache.layers == [] and cache.layout.chunks == [] and not cache.active
    with pytest.raises(ValueError, match=r"call `diffusers_qvg\.attach_cache\(transformer, cache\)` once"):
        with cache.chunk(start_frame=0, hidden_states=x):
            pass
    dq.attach_cache(model, cache)  # the fix: the stream now runs as enable_qvg's
    reference = tiny_wan()
    assert_identical(stream(model, cache), stream(reference, dq.enable_qvg(reference, "bf16", **OPTIONS)))


@torch.no_grad()
def test_a_module_the_cache_did_not_find_in_its_first_chunk_is_refused():
    model, other = tiny_wan(), tiny_wan(seed=1)
    cache = shared_setup(model, "bf16")
    stream(model, cache, chunks=1)
    other.set_attn_processor(dq.QVGWanAttnProcessor(cache))  # the same cache on a second transformer
    with pytest.raises(ValueError, match="already holds the 2 self-attention layers it found"):
        with cache.chunk(start_frame=2):
            dq.installer.add_rope_offset_hook(other.rope, cache, {})
            other(torch.zeros(1, 16, 2, HEIGHT, WIDTH, dtype=torch.float64), torch.tensor([500.0], dtype=torch.float64), TEXT)


def test_attach_checks_the_transformer_and_disable_restores_stock_processors():
    model = tiny_wan()
    with pytest.raises(ValueError, match="has 3 layers but WanTransformer3DModel has 2"):
        dq.attach_cache(model, dq.QVGCache(num_layers=3))
    cache = shared_setup(model, "bf16")
    with pytest.raises(ValueError, match="already enabled"):
        dq.attach_cache(model, cache)
    dq.disable_qvg(model)
    assert all(type(p) is WanAttnProcessor for p in model.attn_processors.values())
    assert getattr(model.rope, "_diffusers_hook", None) is None or model.rope._diffusers_hook.get_hook("qvg_rope_offset") is None
    assert SkyReelsV2AttnProcessor is not WanAttnProcessor  # the stock class follows the cached one's


def test_the_public_constructor_validates_its_arguments():
    with pytest.raises(TypeError, match="config must be a diffusers_qvg.CacheConfig"):
        dq.QVGCache("qvg-int2")
    with pytest.raises(ValueError, match="num_layers=0 is invalid"):
        dq.QVGCache(num_layers=0)
