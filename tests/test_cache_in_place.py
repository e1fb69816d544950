"""BF16 storage with rotated keys attends to its storage in place, as Self-Forcing's cache does.

The in-place window equals the full block-causal forward (float64) and, bit for bit, the general path that
decodes every visible chunk into the shared workspace (``CacheConfig.in_place`` patched off); a denoising
forward copies only its own chunk; chunks that leave the window move forward once, at the next chunk.
"""

import pytest
import torch
from test_cache import assert_unchanged, snapshot
from test_cache_equivalence import generate
from test_cache_recache import FINAL, OLD, SINK_BEFORE_SLIDE, recache, stream
from torch.utils._python_dispatch import TorchDispatchMode
from wan_helpers import HEAD_DIM, HEADS, HEIGHT, TOKENS_PER_FRAME, WIDTH, tiny_wan

import diffusers_qvg as dq
from diffusers_qvg.cache.config import CacheConfig


@torch.no_grad()
@pytest.mark.parametrize("final_pass", [False, True])
@pytest.mark.parametrize("keep_recent_chunks", [0, 2])
def test_sliding_window_with_a_sink_matches_the_equivalent_mask(keep_recent_chunks, final_pass):
    model = tiny_wan()
    commit = "final-pass" if final_pass else "on-advance"
    cache = dq.enable_qvg(model, "bf16", keys_before_rope=False, window_frames=7, sink_frames=2,
                          keep_recent_chunks=keep_recent_chunks, commit=commit, chunk_frames=2)
    assert cache.config.in_place
    frames = [2, 2, 1, 2, 2, 1, 2]  # the window slides by whole chunks of different sizes
    assert generate(model, cache, frames, sink_frames=2, window_frames=7, final_pass=final_pass) <= 1e-10
    for layer in cache.layers:  # one buffer pair per layer, nothing else
        assert (layer.ring, layer.sink, layer.blocks) == (None, None, []) and layer.window is not None
    assert cache.workspace.nbytes == 0


def run_stream(model, cache, frames, seed=3, batch=2):
    """Every output of a stream of chunks (3 denoising forwards and a clean pass each), batch ``batch``."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(batch, 5, 32, generator=g).to(model.dtype)
    outs, start = [], 0
    for n in frames:
        for t in (900.0, 500.0, 100.0, 0.0):
            x = torch.randn(batch, 16, n, HEIGHT, WIDTH, generator=g).to(model.dtype)
            with cache.chunk(start_frame=start, final=t == 0.0 and cache.config.commit == "final-pass"):
                outs.append(model(x, torch.full((batch,), t), text).sample)
        start += n
    return outs


@torch.no_grad()
@pytest.mark.parametrize("commit", ["on-advance", "final-pass"])
def test_in_place_equals_the_decoding_path_bit_for_bit(commit, monkeypatch):
    frames = [2, 2, 2, 1, 2, 2]
    policy = dict(keys_before_rope=False, window_frames=7, sink_frames=2, keep_recent_chunks=1, commit=commit)
    model = tiny_wan(torch.bfloat16)
    in_place = run_stream(model, dq.enable_qvg(model, "bf16", **policy), frames)
    dq.disable_qvg(model)
    monkeypatch.setattr(CacheConfig, "in_place", property(lambda self: False))
    decoded = run_stream(model, dq.enable_qvg(model, "bf16", **policy), frames)
    assert all(torch.equal(a, b) for a, b in zip(in_place, decoded))


class Copies(TorchDispatchMode):
    """Elements written by every ``copy_`` inside."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.sizes.append(args[0].numel())
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_a_denoising_forward_copies_only_its_chunk_and_a_slide_moves_the_history_once():
    model = tiny_wan(torch.float32)
    cache = dq.enable_qvg(model, "bf16", keys_before_rope=False, window_frames=6, sink_frames=2,
                          commit="final-pass", keep_recent_chunks=0)
    run_stream(model, cache, [2, 2, 2], batch=1)  # sink + 2 chunks: the window is full
    chunk = 2 * TOKENS_PER_FRAME * HEADS * HEAD_DIM  # one chunk's K (or V) of one layer
    layers = len(cache.layers)
    x, text = torch.randn(1, 16, 2, HEIGHT, WIDTH), torch.randn(1, 5, 32)
    for step, t in enumerate((900.0, 500.0)):  # the next chunk: its first forward slides the window
        copies = Copies()
        with copies, cache.chunk(start_frame=6):
            model(x, torch.tensor([t]), text)
        writes = [n for n in copies.sizes if n == chunk]
        assert len(writes) == (2 + 2) * layers if step == 0 else 2 * layers  # the move of the kept chunk, once
        assert max(copies.sizes) <= chunk  # nothing larger than a chunk is copied: the history stays
    assert [c.start_frame for c in cache.layout.chunks] == [0, 4, 6]


@torch.no_grad()
def test_memory_report_counts_the_window_buffers_and_steady_state_allocates_nothing():
    model = tiny_wan(torch.float32)
    cache = dq.enable_qvg(model, "bf16", keys_before_rope=False, window_frames=6, sink_frames=2)
    run_stream(model, cache, [2, 2, 2], batch=1)
    report = cache.memory_report()
    buffers = [s.values for layer in cache.layers for s in layer.window.storage]
    assert report.window == sum(t.numel() * t.element_size() for t in buffers)
    assert all(t.shape[1] == 6 * TOKENS_PER_FRAME for t in buffers)  # the window, sink included
    assert (report.sink, report.packed, report.recent, report.current) == (0, 0, 0, 0)
    assert report.cache == report.window
    plan = cache.planned[1]
    assert report.workspace == plan.rotary_nbytes  # no shared window workspace
    pointers = [t.data_ptr() for t in buffers]
    g = torch.Generator().manual_seed(5)
    for start in range(6, 16, 2):
        with cache.chunk(start_frame=start):
            model(torch.randn(1, 16, 2, HEIGHT, WIDTH, generator=g), torch.tensor([0.0]), torch.randn(1, 5, 32, generator=g))
    assert [s.values.data_ptr() for layer in cache.layers for s in layer.window.storage] == pointers


@torch.no_grad()
def test_a_refused_clean_pass_leaves_the_window_as_it_was():
    model = tiny_wan(torch.float32)
    cache = dq.enable_qvg(model, "bf16", keys_before_rope=False, window_frames=6, commit="final-pass")
    run_stream(model, cache, [2, 2], batch=1)
    before = [s.values.clone() for layer in cache.layers for s in layer.window.storage]
    x = torch.randn(1, 16, 2, HEIGHT, WIDTH)
    with cache.chunk(start_frame=4):
        model(x, torch.tensor([500.0]), torch.randn(1, 5, 32))
    layout = cache.layout
    bad = torch.full_like(x, float("nan"))
    with pytest.raises(ValueError, match="NaN or Inf values in layer 0's keys; .*nothing was cached"):
        with cache.chunk(start_frame=4, final=True):
            model(bad, torch.tensor([0.0]), torch.randn(1, 5, 32))
    assert cache.layout is layout  # the chunk is still being denoised
    visible = 2 * 2 * TOKENS_PER_FRAME  # the two stored chunks are untouched (the failed chunk's tail is not visible)
    after = [s.values for layer in cache.layers for s in layer.window.storage]
    assert all(torch.equal(a[:, :visible], b[:, :visible]) for a, b in zip(before, after))
    with cache.chunk(start_frame=4, final=True):  # the pass again, with good latents, stores the chunk
        model(x, torch.tensor([0.0]), torch.randn(1, 5, 32))
    assert [c.start_frame for c in cache.layout.chunks] == [2, 4] and cache.layout.current is None  # 0 left


@torch.no_grad()
def test_a_recache_with_the_same_text_stores_the_same_bits_in_place():
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", keys_before_rope=False, keep_recent_chunks=0, **SINK_BEFORE_SLIDE, **FINAL)
    assert cache.config.in_place
    clean = stream(model, cache, 4)
    def pointers():
        return [t.data_ptr() for layer in cache.layers for s in layer.storages() for t in s.tensors().values()]

    before, where, report = snapshot(cache), pointers(), cache.memory_report()
    assert recache(model, cache, clean, OLD) == [(2, 2), (4, 2), (6, 2)]
    assert_unchanged(cache, before)  # the window buffers bit for bit, their tails included
    assert pointers() == where and cache.memory_report() == report


@torch.no_grad()
def test_a_window_without_a_bound_grows_its_buffers_and_keeps_its_chunks():
    """No window: the buffers grow with the packed pool's blocks (8 chunks each), copying what they hold."""
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", keys_before_rope=False, keep_recent_chunks=0, commit="final-pass")
    frames = [1] * 11
    assert generate(model, cache, frames, final_pass=True) <= 1e-10
    capacities = {layer.window.capacity for layer in cache.layers}
    assert capacities == {(2 * 8 + 1) * TOKENS_PER_FRAME}  # grown once: two blocks of 8 one-frame chunks, + current
