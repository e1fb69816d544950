"""cache.recache(): the visible chunks after the sink stored again by clean-context passes (a prompt switch).

The same text before the window has slid stores the same K/V bit for bit; new text stores what a run that fed
the same clean latents under the new text stores; every refusal leaves the cache as it was.
"""

import pytest
import torch
from test_cache import assert_unchanged, pointers, snapshot
from wan_helpers import HEIGHT, WIDTH, tiny_wan

import diffusers_qvg as dq

FINAL = dict(commit="final-pass")
QVG = dq.QVGConfig(num_centroids=4, group_size=4)  # 8 tokens per chunk: few centroids, groups of 4 channels
G = torch.Generator().manual_seed(11)
OLD, NEW = (torch.randn(1, 5, 32, generator=G, dtype=torch.float64) for _ in range(2))
SINK_BEFORE_SLIDE = dict(window_frames=12, sink_frames=2)  # 4 chunks of 2 frames: nothing evicted yet
SLID_NO_SINK = dict(window_frames=6)  # 6 chunks: frames 8 and 10 still visible


def clean_pass(model, cache, start, x, text):
    with cache.chunk(start_frame=start, final=True):
        model(x, torch.tensor([0.0], dtype=torch.float64), text)


def stream(model, cache, chunks, seed=0, frames=2):
    """A denoising forward and the clean-context pass of each chunk, under OLD; the clean latents by frame."""
    g = torch.Generator().manual_seed(seed)
    clean = {}
    for c in range(chunks):
        start = c * frames
        with cache.chunk(start_frame=start):
            model(torch.randn(1, 16, frames, HEIGHT, WIDTH, generator=g, dtype=torch.float64), torch.tensor([500.0]), OLD)
        clean[start] = torch.randn(1, 16, frames, HEIGHT, WIDTH, generator=g, dtype=torch.float64)
        clean_pass(model, cache, start, clean[start], OLD)
    return clean


def recache(model, cache, clean, text):
    with cache.recache() as chunks:
        for start, _ in chunks:
            clean_pass(model, cache, start, clean[start], text)
    return chunks


def stored_kv(cache):
    """Every cached chunk's stored K (before RoPE) and V per layer, decoded: {start_frame: [(k, v), ...]}."""
    layout, cfg = cache.layout, cache.config
    B, H, D, dtype, _ = cache.geometry
    out = {}
    for c in layout.chunks:
        per_layer = []
        for layer in cache.layers:
            if c.place == "sink":
                codec, kv, src = cfg.sink_storage, layer.sink, (c.start_frame - layout.origin_frame) * layout.tokens_per_frame
            elif c.place == "recent":
                codec, kv, src = cfg.dense, layer.ring, c.slot * layout.slot_tokens
            else:
                codec, kv, src = cfg.storage, layer.blocks[c.block], c.slot * layout.slot_tokens
            table = dq.segment_table([(src, c.tokens, 0, c.slot)])
            k, v = (torch.zeros(B, c.tokens, H, D, dtype=dtype) for _ in range(2))
            codec.dequantize_into(kv[0], table, k)
            codec.dequantize_into(kv[1], table, v)
            per_layer.append((k, v))
        out[c.start_frame] = per_layer
    return out


def places(cache):
    return [(c.start_frame, c.frames, c.place) for c in cache.layout.chunks]


def rel_l2(a, b):
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
@pytest.mark.parametrize("storage", ["bf16", QVG], ids=["bf16", "qvg-int2"])
@pytest.mark.parametrize("keep_recent_chunks", [0, 1])
def test_the_same_text_before_the_window_slid_stores_the_same_bits_in_the_same_storage(storage, keep_recent_chunks):
    model = tiny_wan()
    cache = dq.enable_qvg(model, storage, keep_recent_chunks=keep_recent_chunks, **SINK_BEFORE_SLIDE, **FINAL)
    clean = stream(model, cache, 4)
    before, where, report = snapshot(cache), pointers(cache), cache.memory_report()
    assert recache(model, cache, clean, OLD) == [(2, 2), (4, 2), (6, 2)]  # the sink (frames 0-1) is kept
    assert_unchanged(cache, before)
    assert pointers(cache) == where and cache.memory_report() == report


def switched_and_reference(storage, policy, keep_recent_chunks=1):
    """A stream under OLD switched to NEW (re-cached), and a fresh cache fed the sink's clean latents under
    OLD and the re-cached chunks' under NEW: the clean-context passes the re-cache ran, from scratch."""
    chunks = 4 if policy is SINK_BEFORE_SLIDE else 6
    model = tiny_wan()
    cache = dq.enable_qvg(model, storage, keep_recent_chunks=keep_recent_chunks, **policy, **FINAL)
    clean = stream(model, cache, chunks)
    old = stored_kv(cache)
    visible = recache(model, cache, clean, NEW)
    ref_model = tiny_wan()
    reference = dq.enable_qvg(ref_model, storage, keep_recent_chunks=keep_recent_chunks, **policy, **FINAL)
    for start in [c.start_frame for c in cache.layout.chunks if c.place == "sink"]:
        clean_pass(ref_model, reference, start, clean[start], OLD)
    for start, _ in visible:
        clean_pass(ref_model, reference, start, clean[start], NEW)
    assert places(cache) == places(reference)
    return stored_kv(cache), stored_kv(reference), old, {c.start_frame: c.place for c in cache.layout.chunks}


@torch.no_grad()
@pytest.mark.parametrize("policy", [SINK_BEFORE_SLIDE, SLID_NO_SINK], ids=["sink", "slid"])
def test_a_switch_stores_what_clean_passes_under_the_new_text_store(policy):
    """bf16 storage in float64: equal to the reference bit for bit (after a slide the first visible chunk sees
    less than it saw when it was made: the reference starts there too)."""
    got, want, old, place = switched_and_reference("bf16", policy)
    assert got.keys() == want.keys()
    for start in got:
        assert all(torch.equal(a, b) for kv, ref in zip(got[start], want[start]) for a, b in zip(kv, ref))
    for start in got:  # the sink keeps its K/V; layer 1 (after a cross-attention) sees the new text
        assert torch.equal(got[start][1][1], old[start][1][1]) == (place[start] == "sink")


@torch.no_grad()
@pytest.mark.parametrize("policy", [SINK_BEFORE_SLIDE, SLID_NO_SINK], ids=["sink", "slid"])
def test_a_quantized_switch_repacks_the_window_within_the_codec_error(policy):
    """qvg-int2, every chunk packed: the reference run packs the same K/V (bit for bit), and both are within
    the codec's error of the exact K/V (bf16 storage): at most 1.5x what the codec loses packing the exact
    K/V itself (the rest: the error the packed context feeds into later chunks)."""
    got, want, _, place = switched_and_reference(QVG, policy, keep_recent_chunks=0)
    assert all(torch.equal(a, b) for s in got for kv, ref in zip(got[s], want[s]) for a, b in zip(kv, ref))
    exact, _, _, _ = switched_and_reference("bf16", policy, keep_recent_chunks=0)
    assert set(place.values()) <= {"sink", "packed"}
    for start in [s for s, p in place.items() if p == "packed"]:
        for (k, v), (k_exact, v_exact) in zip(got[start], exact[start]):
            for x, x_exact, role in ((k, k_exact, "key"), (v, v_exact, "value")):
                own = rel_l2(dq.dequantize(dq.quantize(x_exact, QVG, role=role)), x_exact)
                assert 0 < rel_l2(x, x_exact) <= 1.5 * own


# ----------------------------------------------------------------------------------------- refusals
@pytest.fixture
def switching():
    """Four finished chunks (the sink and three after it) and their clean latents."""
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", **SINK_BEFORE_SLIDE, **FINAL)
    with torch.no_grad():
        clean = stream(model, cache, 4)
    return model, cache, clean


def skip_the_first(model, cache, clean):
    clean_pass(model, cache, 4, clean[4], NEW)


def denoise_instead(model, cache, clean):
    with cache.chunk(start_frame=2):
        model(clean[2], torch.tensor([500.0]), NEW)


def one_frame_short(model, cache, clean):
    clean_pass(model, cache, 2, clean[2][:, :, :1], NEW)


def nest(model, cache, clean):
    with cache.recache():
        pass


def reset_inside(model, cache, clean):
    cache.reset()


def raise_in_the_model(model, cache, clean):
    with cache.chunk(start_frame=2, final=True):
        raise RuntimeError("the model stopped")


def infinite_latents(model, cache, clean):
    bad = clean[2].clone()
    bad[0, 0, 0, 0, 0] = float("inf")
    clean_pass(model, cache, 2, bad, NEW)  # the device-side check fails at the first write


@torch.no_grad()
@pytest.mark.parametrize(
    "misuse, error, match",
    [
        (skip_the_first, ValueError, r"clean-context pass of the chunk at frame 2 .*got start_frame=4"),
        (denoise_instead, ValueError, r"cache.chunk\(start_frame=2, final=True\).*final=False"),
        (one_frame_short, ValueError, "has 2 frames but this re-cache pass has 1"),
        (nest, RuntimeError, "do not nest"),
        (reset_inside, RuntimeError, r"reset\(\) inside a cache.recache\(\) block"),
        (lambda *args: None, RuntimeError, "ended before storing the chunk at frame 2 again.*unchanged"),
        (raise_in_the_model, RuntimeError, "the model stopped"),
        (infinite_latents, ValueError, "nothing was cached"),
    ],
)
def test_a_recache_refused_before_its_first_chunk_is_stored_leaves_the_cache_as_it_was(switching, misuse, error, match):
    model, cache, clean = switching
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        with cache.recache():
            misuse(model, cache, clean)
    assert_unchanged(cache, before)
    assert cache.recaching is None and not cache.active
    recache(model, cache, clean, OLD)  # and the cache goes on
    assert_unchanged(cache, before)


@torch.no_grad()
def test_a_recache_needs_final_pass_commits_and_a_finished_chunk(switching):
    model, cache, clean = switching
    before = snapshot(cache)
    with cache.chunk(start_frame=8):
        model(clean[2], torch.tensor([500.0]), OLD)
    with pytest.raises(RuntimeError, match=r"frame 8 is being denoised.*cache.chunk\(start_frame=8, final=True\)"):
        with cache.recache():
            pass
    on_advance = dq.enable_qvg(tiny_wan(), "bf16")
    with pytest.raises(ValueError, match="only commit='final-pass' has"):
        with on_advance.recache():
            pass
    clean_pass(model, cache, 8, clean[2], OLD)
    assert cache.layout.next_frame == 10 and before[0].next_frame == 8


@torch.no_grad()
def test_a_recache_that_stops_after_storing_a_chunk_refuses_to_go_on_until_reset(switching):
    model, cache, clean = switching
    with pytest.raises(RuntimeError, match="stopped after storing 1 of 3 chunks again.*cache.reset()"):
        with cache.recache():
            clean_pass(model, cache, 2, clean[2], NEW)
    with pytest.raises(RuntimeError, match="1 of 3 chunks"):
        clean_pass(model, cache, 8, clean[2], NEW)
    cache.reset()
    stream(model, cache, 1)
    assert places(cache) == [(0, 2, "sink")]


@torch.no_grad()
def test_only_a_sink_leaves_nothing_to_recache():
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", **SINK_BEFORE_SLIDE, **FINAL)
    clean = stream(model, cache, 1)
    before = snapshot(cache)
    assert recache(model, cache, clean, NEW) == []
    assert_unchanged(cache, before)
