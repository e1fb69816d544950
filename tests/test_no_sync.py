"""The read path never reads device memory on the host, and a quantize reads it once.

On CPU a device sync cannot be observed, so the structure is checked instead: segment tables whose device
tensor lives on the ``meta`` device, where every host read (``.cpu()``, ``.tolist()``, ``bool()``) raises.
Decoding and a whole cached attention step must give the same bytes with them as with real tables. On
CUDA (marked ``gpu``) ``torch.cuda.set_sync_debug_mode`` checks the real thing.
"""

import dataclasses
import warnings
from contextlib import contextmanager

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
from test_cache_quantized import CHUNKS, FRAMES, HEIGHT, WIDTH, B, D, video_like

import diffusers_qvg as dq
from diffusers_qvg.attention import cached_self_attention

def on_meta(table: dq.SegmentTable | None) -> dq.SegmentTable | None:
    """The same rows with a device tensor that has no data: any host read of it raises."""
    return None if table is None else dq.SegmentTable(table.rows, table.tensor.to("meta"))


def meta_plan(plan):
    packed = tuple((block, on_meta(table)) for block, table in plan.packed)
    return dataclasses.replace(plan, sink=on_meta(plan.sink), packed=packed, recent=on_meta(plan.recent))


def test_a_host_read_of_a_meta_table_raises():
    """The control: the tests below would fail if a decoder read the device table on the host."""
    tensor = on_meta(dq.segment_table([(0, 2, 0, 0)])).tensor
    for read in (lambda: tensor.cpu(), lambda: tensor.tolist(), lambda: bool((tensor < 1).any())):
        with pytest.raises((NotImplementedError, RuntimeError)):
            read()


CODECS = {
    "bf16": (dq.BF16Config(), "value"),
    "qvg": (dq.QVGConfig(num_centroids=4), "value"),
    "rtn": (dq.QVGConfig.rtn(), "value"),
    "kivi-keys": (dq.KIVIConfig(key_group_tokens=8), "key"),
    "kivi-values": (dq.KIVIConfig(), "value"),
    "nvfp4": (dq.NVFP4Config(), "value"),
}


@torch.no_grad()
@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rope"])
def test_dequantize_reads_only_the_host_rows(name, rotary):
    config, role = CODECS[name]
    g = torch.Generator().manual_seed(0)
    storage = config.allocate(batch=1, capacity_tokens=32, heads=2, head_dim=64, num_slots=2, dtype=torch.float32, device="cpu", role=role)
    for slot in range(2):
        config.quantize_into(storage, torch.randn(1, 16, 2, 64, generator=g), token_start=16 * slot, slot=slot, role=role)
    table = dq.segment_table([(16, 16, 0, 1), (0, 13, 19, 0)])
    angles = torch.randn(1, 32, 1, 32, generator=g).repeat_interleave(2, dim=-1)
    rope = (angles.cos(), angles.sin()) if rotary else None
    expected, out = (torch.full((1, 32, 2, 64), 7.0) for _ in range(2))
    config.dequantize_into(storage, table, expected, rope)
    config.dequantize_into(storage, on_meta(table), out, rope)
    assert torch.equal(out, expected) and not (expected == 7.0).all()


def build_cache(storage, device):
    """A one-layer cache whose window holds a sink, a packed, a recent and the current chunk."""
    g = torch.Generator().manual_seed(7)
    keys, values, queries = (video_like(g, 1.0).to(device) for _ in range(3))
    rope = WanRotaryPosEmbed(D, (1, 1, 1), max_seq_len=32).to(device)
    cache = dq.QVGCache(dq.CacheConfig(storage=storage, sink_frames=FRAMES, sink_storage=storage), num_layers=1)
    latent = torch.zeros(B, 1, FRAMES, HEIGHT, WIDTH, device=device)
    for c in range(CHUNKS):
        with cache.chunk(start_frame=c * FRAMES):
            rotary = cache.begin_forward(rope, latent, FRAMES, HEIGHT, WIDTH)
            cached_self_attention(cache.layers[0], queries[c], keys[c], values[c], rotary)
    assert [c.place for c in cache.layout.chunks] == ["sink", "packed", "recent", "current"]
    last = CHUNKS - 1

    @contextmanager
    def rewrite():
        """Inside: the last chunk's forward has begun; yields one layer's attention step over the cache."""
        with cache.chunk(start_frame=last * FRAMES):
            rotary = cache.begin_forward(rope, latent, FRAMES, HEIGHT, WIDTH)
            yield lambda: cached_self_attention(cache.layers[0], queries[last], keys[last], values[last], rotary)

    return cache, rewrite


STORAGES = {"bf16": "bf16", "qvg-int2": dq.QVGConfig(num_centroids=16)}


@torch.no_grad()
@pytest.mark.parametrize("name", STORAGES)
def test_cached_attention_step_reads_no_segment_table_on_the_host(name):
    cache, rewrite = build_cache(STORAGES[name], "cpu")
    with rewrite() as step:
        expected = step()
        cache.plan = meta_plan(cache.plan)
        out = step()
    assert torch.equal(out, expected)


@torch.no_grad()
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["bf16", "qvg-int2"])
def test_cached_attention_step_does_not_synchronise_on_cuda(name):
    cache, rewrite = build_cache(name, "cuda")
    with rewrite() as step:
        step()  # warm: Triton compiles, cuBLAS/SDPA initialise
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert out.is_cuda and torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_segment_tables_reach_cuda_without_a_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        table = dq.segment_table([(0, 4680, 0, 0), (4680, 4680, 9360, 1)], device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert table.tensor.cpu().tolist() == [list(r) for r in table.rows]


@torch.no_grad()
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm-start"])
def test_quantize_into_synchronises_once_on_cuda(warm):
    config = dq.QVGConfig(num_centroids=16)
    x = video_like(torch.Generator().manual_seed(0), 1.0)[0].cuda()
    B_, N, H, D_ = x.shape
    storage = config.allocate(batch=B_, capacity_tokens=2 * N, heads=H, head_dim=D_, num_slots=2, dtype=x.dtype, device="cuda")
    config.quantize_into(storage, x, token_start=0, slot=0)  # warm: kernels compiled, constants on the device
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            config.quantize_into(storage, x, token_start=N, slot=1, warm_start=storage if warm else None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
