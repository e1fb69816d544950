"""The cache's contract: errors leave state untouched, memory is exact, the pool is reused, install/uninstall."""

import copy

import pytest
import torch
from diffusers import FirstBlockCacheConfig
from wan_helpers import HEAD_DIM, HEADS, HEIGHT, TOKENS_PER_FRAME, WIDTH, tiny_wan

import diffusers_qvg as dq
from diffusers_qvg.rope_offset import ROPE_OFFSET_HOOK

G = torch.Generator().manual_seed(3)
TEXT = torch.randn(1, 5, 32, generator=G, dtype=torch.float64)


def latents(frames=2, batch=1):
    return torch.randn(batch, 16, frames, HEIGHT, WIDTH, generator=G, dtype=torch.float64)


def forward(model, cache, start, frames=2, batch=1, x=None):
    with cache.chunk(start_frame=start):
        return model(latents(frames, batch) if x is None else x, torch.tensor([500.0] * batch), TEXT.expand(batch, -1, -1))


def run(model, cache, chunks, frames=2):
    for c in range(chunks):
        forward(model, cache, c * frames, frames)
        forward(model, cache, c * frames, frames)


def snapshot(cache):
    """Every tensor and index of the cache, copied. The workspace is scratch: its allocation is state, its
    contents are not (every read rewrites the whole window before attention sees it), and a refused
    clean-context pass is found refused only after its forward has read the window."""
    tensors = [t.clone() for layer in cache.layers for s in layer.storages() for t in s.tensors().values()]
    workspace = None if cache.workspace.keys is None else (cache.workspace.keys.shape, cache.workspace.keys.dtype)
    return copy.deepcopy(cache.layout), cache.geometry, tensors, workspace


def assert_unchanged(cache, before):
    layout, geometry, tensors, workspace = snapshot(cache)
    assert layout == before[0] and geometry == before[1] and workspace == before[3]
    # bitwise: the workspace is allocated uninitialised and may hold NaN patterns
    same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(tensors, before[2])]
    assert len(tensors) == len(before[2]) and all(same)


@pytest.fixture
def setup():
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", window_frames=8, sink_frames=2)
    with torch.no_grad():
        run(model, cache, 3)
    return model, cache


@torch.no_grad()
def test_rewrite_of_another_size_raises_with_layer_start_sizes_and_fixes(setup):
    model, cache = setup
    before = snapshot(cache)
    with pytest.raises(dq.ChunkRewriteSizeError) as err:
        forward(model, cache, 4, frames=1)
    assert isinstance(err.value, ValueError)
    message = str(err.value)
    for part in ("layer 0", "frame 4", "8 tokens", "has 4", "same length", "advance"):
        assert part in message
    assert_unchanged(cache, before)


@torch.no_grad()
@pytest.mark.parametrize("start", [0, 2, 5, 8, -1])
def test_non_sequential_chunk_raises_before_anything_changes(setup, start):
    model, cache = setup
    before = snapshot(cache)
    with pytest.raises(ValueError, match="start_frame|neither the current chunk"):
        forward(model, cache, start)
    assert_unchanged(cache, before)
    assert not cache.active


@torch.no_grad()
def test_nan_input_and_batch_change_raise_before_anything_changes(setup):
    model, cache = setup
    before = snapshot(cache)
    bad = latents()
    bad[0, 0, 0, 0, 0] = float("nan")
    for start in (4, 6):  # a rewrite and an advance
        with pytest.raises(ValueError, match="NaN or Inf"):
            forward(model, cache, start, x=bad)
        with pytest.raises(ValueError, match="batch 2"):
            forward(model, cache, start, batch=2)
    assert_unchanged(cache, before)


def bad_kv(kind):
    shape = [1, 2 * TOKENS_PER_FRAME, HEADS, HEAD_DIM]
    dtype, device = torch.float64, "cpu"
    if kind == "heads":
        shape[2] = 3
    if kind == "dtype":
        dtype = torch.float32
    if kind == "device":
        device = "meta"
    return torch.zeros(shape, dtype=dtype, device=device)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["heads", "dtype", "device"])
def test_layer_update_rejects_mismatched_kv_and_changes_nothing(setup, kind):
    model, cache = setup
    k = bad_kv(kind)
    with cache.chunk(start_frame=4):
        model(latents(), torch.tensor([500.0]), TEXT)  # begin a forward so the layer has a read plan
        before = snapshot(cache)
        with pytest.raises(ValueError, match={"heads": "heads", "dtype": "dtype|float32", "device": "meta"}[kind]):
            cache.layers[1].update(k, k, k)
    assert_unchanged(cache, before)


def test_layout_errors_name_the_fix():
    model = tiny_wan()
    with torch.no_grad():
        cache = dq.enable_qvg(model, "bf16", sink_frames=3)
        forward(model, cache, 0)
        with pytest.raises(ValueError, match="chunk boundary"):
            forward(model, cache, 2)
        cache.reset()
        forward(model, cache, 0, frames=1)
        with pytest.raises(ValueError, match="chunk_frames=2"):
            forward(model, cache, 1, frames=2)
    with pytest.raises(ValueError, match="window_frames"):
        dq.enable_qvg(tiny_wan(), "bf16", window_frames=2, sink_frames=2)
    with pytest.raises(ValueError, match="unknown KV cache storage"):
        dq.enable_qvg(tiny_wan(), "int3")


def storage_bytes(storages):
    return sum(t.numel() * t.element_size() for s in storages for t in s.tensors().values())


@torch.no_grad()
def test_memory_report_is_exact(setup):
    model, cache = setup
    report = cache.memory_report()
    layers = cache.layers
    assert report.sink == storage_bytes(s for l in layers for s in l.sink)
    assert report.packed == storage_bytes(s for l in layers for kv in l.blocks for s in kv)
    assert report.recent + report.current == storage_bytes(s for l in layers for s in l.ring)
    assert report.current == report.recent  # keep_recent_chunks=1: one slot each
    ws = cache.workspace
    plan = cache.planned[1]
    rotary = plan.rotary.table.numel() * plan.rotary.table.element_size() + sum(t.numel() * t.element_size() for t in plan.current_rotary)
    assert report.workspace == ws.keys.numel() * ws.keys.element_size() * 2 + rotary
    assert report.total == report.cache + report.workspace
    # visible: the sink chunk and the two newest chunks, 8 tokens each, as BF16 K and V in 2 layers
    assert report.cached_tokens == 3 * 2 * TOKENS_PER_FRAME
    assert report.bf16_equivalent == report.cached_tokens * HEADS * HEAD_DIM * 2 * 2 * 2


def pointers(cache):
    """Where every storage tensor and the workspace live (unchanged: nothing was allocated)."""
    return [t.data_ptr() for l in cache.layers for s in l.storages() for t in s.tensors().values()] + [
        cache.workspace.keys.data_ptr()
    ]


@torch.no_grad()
def test_steady_state_reuses_storage(setup):
    model, cache = setup
    forward(model, cache, 6)  # the window is full from here on
    first = pointers(cache)
    for c in range(4, 9):
        forward(model, cache, c * 2)
        assert pointers(cache) == first


def test_stock_outputs_without_an_active_chunk_and_after_disable():
    model = tiny_wan(torch.float32)
    x = torch.randn(1, 16, 3, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(0))
    t, text = torch.tensor([700.0]), TEXT.float()
    with torch.no_grad():
        stock = model(x, t, text).sample
        originals = model.attn_processors
        cache = dq.enable_qvg(model, "qvg-int2", window_frames=12)
        assert isinstance(model.blocks[0].attn1.processor, dq.QVGWanAttnProcessor)
        assert model.blocks[0].attn2.processor is originals["blocks.0.attn2.processor"]
        assert torch.equal(model(x, t, text).sample, stock)
        with pytest.raises(ValueError, match="already enabled"):
            dq.enable_qvg(model)
        dq.disable_qvg(model)
        assert model.attn_processors == originals
        assert model.rope._diffusers_hook.get_hook(ROPE_OFFSET_HOOK) is None
        assert torch.equal(model(x, t, text).sample, stock)
        with pytest.raises(ValueError, match="not enabled"):
            dq.disable_qvg(model)
        assert not cache.active


@torch.no_grad()
def test_processors_for_reinstalls_the_same_cache():
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16")
    x = latents()
    first = forward(model, cache, 0, x=x).sample
    model.set_attn_processor(dq.processors_for(model, cache))
    assert torch.equal(forward(model, cache, 0, x=x).sample, first)


def test_block_skipping_caches_are_refused():
    model = tiny_wan()
    model.enable_cache(FirstBlockCacheConfig(threshold=0.1))
    with pytest.raises(ValueError, match="block-skipping"):
        dq.enable_qvg(model)
    model.disable_cache()
    cache = dq.enable_qvg(model, "bf16")
    model.enable_cache(FirstBlockCacheConfig(threshold=0.1))
    with pytest.raises(ValueError, match="disable_cache"):
        with cache.chunk(start_frame=0):
            pass


@torch.no_grad()
def test_fused_projections_and_attention_backend_are_honoured():
    model, fused = tiny_wan(), tiny_wan()
    caches = [dq.enable_qvg(m, "bf16") for m in (model, fused)]
    fused.fuse_qkv_projections()
    fused.set_attention_backend("native")
    assert fused.blocks[1].attn1.processor._attention_backend == "native"
    fused.set_attn_processor(dq.processors_for(fused, caches[1]))
    assert fused.blocks[1].attn1.processor._attention_backend == "native"
    for start in (0, 0, 2):
        x = latents()
        outs = [forward(m, c, start, x=x).sample for m, c in zip((model, fused), caches)]
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)


def test_the_default_storage_is_qvg_int2_and_the_sink_stays_bf16():
    config = dq.CacheConfig()
    assert config.storage == dq.QVGConfig() and config.sink_storage == dq.BF16Config()
