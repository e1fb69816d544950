"""commit="final-pass": only the clean-context pass stores a chunk. Same outputs as "on-advance", no current
slot, the same error guarantees (every error before any state change)."""

import copy
from contextlib import nullcontext

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
from test_cache import TEXT, assert_unchanged, latents, pointers, snapshot, storage_bytes
from test_cache_equivalence import generate
from test_cache_quantized import FRAMES, HEIGHT, QVG, WIDTH, D, video_like
from wan_helpers import tiny_wan

import diffusers_qvg as dq
from diffusers_qvg.attention import cached_self_attention
from diffusers_qvg.cache.layout import ChunkLayout, Pack, ToRing, ToSink
from diffusers_qvg.codecs.qvg import backend

FINAL = dict(commit="final-pass")


# ----------------------------------------------------------------------------------------- bookkeeping
def finish(layout, chunks, frames=3):
    """Denoise (plan) then finalize ``chunks`` chunks; each final pass's moves, checking nothing is mutated."""
    steps = []
    for _ in range(chunks):
        layout, moves = layout.plan(layout.next_frame, frames, 2, 2)
        assert moves == [] and layout.current.slot is None  # a denoising forward stores nothing
        before = copy.deepcopy(layout)
        final, moves = layout.finalize()
        assert layout == before
        layout = final
        steps.append(moves)
    return layout, steps


def test_longlive_window_stores_each_chunk_once_and_packs_only_what_the_next_chunk_reads():
    layout, steps = finish(ChunkLayout(dq.CacheConfig(window_frames=12, sink_frames=3, **FINAL)), 8)
    assert [(c.start_frame, c.place) for c in layout.chunks] == [(0, "sink"), (18, "packed"), (21, "recent")]
    assert layout.current is None and layout.next_frame == 24
    assert steps[0] == [ToSink(ring_slot=None, sink_slot=0, token_start=0, tokens=12)]
    assert steps[1] == [ToRing(slot=0, tokens=12)]
    # the oldest recent chunk is packed (from its ring slot) before the new one takes that slot
    assert steps[2] == [Pack(ring_slot=0, block=0, slot=0, tokens=12, warm=None), ToRing(slot=0, tokens=12)]
    assert all(step == steps[2] for step in steps[3:])  # the chunk the next one cannot see is evicted unpacked
    assert (layout.ring_slots, layout.block_slots, layout.num_blocks) == (1, 1, 1)


def test_without_recent_chunks_the_final_pass_packs_its_own_kv():
    layout, steps = finish(ChunkLayout(dq.CacheConfig(keep_recent_chunks=0, warm_start=True, **FINAL)), 3)
    assert layout.ring_slots == 0
    assert steps == [[Pack(None, 0, 0, 12, None)], [Pack(None, 0, 1, 12, (0, 0))], [Pack(None, 0, 2, 12, (0, 1))]]


@pytest.mark.parametrize(
    "options, block_slots",
    [
        (dict(expected_frames=21, keep_recent_chunks=0, **FINAL), 7),  # every chunk of the video, packed
        (dict(expected_frames=21, **FINAL), 6),  # one stays recent
        (dict(expected_frames=21), 5),  # "on-advance": one recent, one current
        (dict(expected_frames=21, window_frames=12, **FINAL), 2),  # the window binds first: (12 - 1) // 3 - 1
        (dict(window_frames=12), 2),  # "on-advance" as before: 12 // 3 - 1 - 1
        (dict(**FINAL), 8),  # unknown length: blocks of 8 chunks
    ],
)
def test_packed_pool_is_sized_for_the_chunks_that_can_be_resident(options, block_slots):
    layout, _ = ChunkLayout(dq.CacheConfig(**options)).plan(0, 3, 2, 2)
    assert layout.block_slots == block_slots


# ----------------------------------------------------------------------------------------- equivalence
@torch.no_grad()
@pytest.mark.parametrize("keep_recent_chunks", [0, 1])
@pytest.mark.parametrize("keys_before_rope", [True, False])
def test_four_chunks_match_block_causal_full_forward(keys_before_rope, keep_recent_chunks):
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", keys_before_rope=keys_before_rope, keep_recent_chunks=keep_recent_chunks, **FINAL)
    assert generate(model, cache, [2, 2, 2, 2], final_pass=True) <= 1e-10
    assert [c.place for c in cache.layout.chunks] == ["packed"] * (4 - keep_recent_chunks) + ["recent"] * keep_recent_chunks


@torch.no_grad()
@pytest.mark.parametrize("keep_recent_chunks", [0, 1, 2])
def test_sink_and_sliding_window_match_the_equivalent_mask(keep_recent_chunks):
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", window_frames=7, sink_frames=2, keep_recent_chunks=keep_recent_chunks, **FINAL)
    assert generate(model, cache, [2] * 6, sink_frames=2, window_frames=7, final_pass=True) <= 1e-10
    # between chunks: the sink and what the next chunk (>= 1 frame) can still see
    assert [c.start_frame for c in cache.layout.chunks] == [0, 8, 10]


@torch.no_grad()
def test_variable_chunk_sizes_with_declared_slot_size():
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", window_frames=6, chunk_frames=2, keep_recent_chunks=0, **FINAL)
    assert generate(model, cache, [1, 2, 2, 2], window_frames=6, final_pass=True) <= 1e-10


def forwards(chunks, frames=2, steps=(900.0, 300.0)):
    """Per chunk: denoising forwards, then the clean-context pass; chunk 1 has only a final pass (a prefill)."""
    for c in range(chunks):
        for t in (() if c == 1 else steps) + (0.0,):
            yield c * frames, t == 0.0, latents(frames), t


@torch.no_grad()
@pytest.mark.parametrize("keep_recent_chunks", [0, 1])
def test_final_pass_and_on_advance_give_identical_outputs(keep_recent_chunks):
    options = dict(window_frames=7, sink_frames=2, keep_recent_chunks=keep_recent_chunks)
    models = [tiny_wan(), tiny_wan()]
    caches = [dq.enable_qvg(models[0], "bf16", **options), dq.enable_qvg(models[1], "bf16", **options, **FINAL)]
    for start, final, x, t in forwards(chunks=6):
        outs = []
        for model, cache in zip(models, caches):
            with cache.chunk(start_frame=start, final=final):  # final=True changes nothing for "on-advance"
                outs.append(model(x, torch.tensor([t], dtype=torch.float64), TEXT).sample)
        assert torch.equal(outs[0], outs[1])


def attend_chunks(storage, keep_recent_chunks, **options):
    """One layer, 4 chunks of 512 tokens, two noisy forwards then a clean pass each: every attention output."""
    g = torch.Generator().manual_seed(7)
    keys, values, queries = video_like(g, 1.0, outlier=4.0), video_like(g, 1.0), video_like(g, 1.0)
    rope = WanRotaryPosEmbed(D, (1, 1, 1), max_seq_len=32)
    cache = dq.QVGCache(dq.CacheConfig(storage=storage, keep_recent_chunks=keep_recent_chunks, **options), num_layers=1)
    latent = torch.zeros(1, 1, FRAMES, HEIGHT, WIDTH)
    outs = []
    for c in range(len(keys)):
        for noise in (0.5, 0.25, 0.0):
            k, v = (t + noise * torch.randn(t.shape, generator=g) for t in (keys[c], values[c]))
            with cache.chunk(start_frame=c * FRAMES, final=noise == 0.0):
                rotary = cache.begin_forward(rope, latent, FRAMES, HEIGHT, WIDTH)
                outs.append(cached_self_attention(cache.layers[0], queries[c], k, v, rotary))
    return outs, cache


@torch.no_grad()
@pytest.mark.parametrize("keep_recent_chunks", [0, 1])
def test_quantized_history_is_read_exactly_as_on_advance(keep_recent_chunks):
    """The clean-context pass reads the window before it packs anything: bit-identical to "on-advance",
    warm start included."""
    default, _ = attend_chunks(QVG, keep_recent_chunks, warm_start=True)
    final, cache = attend_chunks(QVG, keep_recent_chunks, warm_start=True, **FINAL)
    assert all(torch.equal(a, b) for a, b in zip(default, final))
    assert [c.place for c in cache.layout.chunks] == ["packed"] * (4 - keep_recent_chunks) + ["recent"] * keep_recent_chunks


# ----------------------------------------------------------------------------------------- memory
def run_chunks(model, cache, chunks, frames=2):
    for c in range(chunks):
        for final in (False, True):
            with cache.chunk(start_frame=c * frames, final=final):
                model(latents(frames), torch.tensor([0.0 if final else 500.0]), TEXT)


@torch.no_grad()
@pytest.mark.parametrize("keep_recent_chunks", [0, 1])
def test_memory_report_has_no_current_slot(keep_recent_chunks):
    models = [tiny_wan(), tiny_wan()]
    caches = [dq.enable_qvg(m, "bf16", keep_recent_chunks=keep_recent_chunks, **o) for m, o in zip(models, ({}, FINAL))]
    for model, cache in zip(models, caches):
        run_chunks(model, cache, 4)
    default, final = (c.memory_report() for c in caches)
    layers = caches[1].layers
    assert final.current == 0
    assert final.recent == storage_bytes(s for l in layers if l.ring for s in l.ring)
    assert final.packed == storage_bytes(s for l in layers for kv in l.blocks for s in kv)
    assert all(l.ring is None for l in layers) == (keep_recent_chunks == 0)
    assert final.recent == keep_recent_chunks * default.current  # one BF16 slot per recent chunk, no more
    assert final.cached_tokens == default.cached_tokens and final.bf16_equivalent == default.bf16_equivalent
    assert default.cache - final.cache == default.current  # same packed pool, one BF16 chunk slot less


@torch.no_grad()
def test_expected_frames_fill_the_packed_pool_exactly():
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", keep_recent_chunks=0, expected_frames=8, **FINAL)
    run_chunks(model, cache, 4)
    report = cache.memory_report()
    assert cache.layout.num_blocks == 1 and all(c.place == "packed" for c in cache.layout.chunks)
    slot = storage_bytes(cache.layers[0].blocks[0]) // cache.layout.block_slots
    assert report.cache == report.packed == 4 * slot * len(cache.layers)


@torch.no_grad()
def test_steady_state_reuses_storage():
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", window_frames=8, sink_frames=2, **FINAL)
    run_chunks(model, cache, 4)  # the window is full from here on
    first = pointers(cache)
    for c in range(4, 9):
        for final in (False, True):
            with cache.chunk(start_frame=c * 2, final=final):
                model(latents(), torch.tensor([500.0]), TEXT)
            assert pointers(cache) == first


# ----------------------------------------------------------------------------------------- errors
@pytest.fixture
def setup():
    """A final-pass cache after two finished chunks and one denoising forward of the third (frame 4)."""
    model = tiny_wan()
    cache = dq.enable_qvg(model, "bf16", window_frames=8, sink_frames=2, **FINAL)
    with torch.no_grad():
        run_chunks(model, cache, 2)
        with cache.chunk(start_frame=4):
            model(latents(), torch.tensor([500.0]), TEXT)
    return model, cache


def forward(model, cache, start, final=False, frames=2, batch=1, x=None):
    with cache.chunk(start_frame=start, final=final):
        return model(latents(frames, batch) if x is None else x, torch.tensor([0.0] * batch), TEXT.expand(batch, -1, -1))


def refused(model, cache, match, error=ValueError, **kwargs):
    """``forward(**kwargs)`` raises ``error`` matching ``match`` and leaves every tensor and index as it was."""
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        forward(model, cache, **kwargs)
    assert_unchanged(cache, before)
    assert not cache.active


@torch.no_grad()
@pytest.mark.parametrize("final", [False, True])
def test_advancing_past_a_chunk_without_its_final_pass_raises_before_anything_changes(setup, final):
    model, cache = setup
    fix = r"frame 4 never had its final pass.*cache\.chunk\(start_frame=4, final=True\).*commit='on-advance'"
    refused(model, cache, fix, start=6, final=final)


@torch.no_grad()
@pytest.mark.parametrize("final", [False, True])
def test_a_chunk_after_its_final_pass_cannot_be_written_again(setup, final):
    model, cache = setup
    forward(model, cache, 4, final=True)
    refused(model, cache, "frame 4 already had its final pass.*next chunk starts at frame 6", start=4, final=final)
    with pytest.raises(ValueError, match="already had its final pass"):  # two forwards in one final block
        with cache.chunk(start_frame=6, final=True):
            model(latents(), torch.tensor([0.0]), TEXT)
            after_first = snapshot(cache)
            model(latents(), torch.tensor([0.0]), TEXT)
    assert_unchanged(cache, after_first)
    assert [c.start_frame for c in cache.layout.chunks] == [0, 4, 6] and cache.layout.current is None


@torch.no_grad()
@pytest.mark.parametrize(
    "start, match",
    [
        (0, "frame 0 is not the next chunk to write \\(frame 4\\)"),  # frame 4 is in progress
        (5, "frame 5 is not the next chunk to write"),
        (8, "frame 8 is not the next chunk to write"),
        (-1, "start_frame=-1 is invalid"),
    ],
)
def test_out_of_order_chunks_name_the_expected_frame_and_change_nothing(setup, start, match):
    model, cache = setup
    refused(model, cache, match, start=start, final=True)


@torch.no_grad()
def test_bad_final_pass_inputs_raise_before_anything_changes_then_the_pass_succeeds(setup):
    model, cache = setup
    bad = latents()
    bad[0, 0, 0, 0, 0] = float("inf")
    refused(model, cache, "holds 8 tokens", dq.ChunkRewriteSizeError, start=4, final=True, frames=1)
    refused(model, cache, "NaN or Inf", start=4, final=True, x=bad)
    refused(model, cache, "batch 2", start=4, final=True, batch=2)
    refused(model, cache, "final=1 is invalid", start=4, final=1)
    forward(model, cache, 4, final=True)
    assert cache.layout.current is None and cache.layout.next_frame == 6


def test_invalid_commit_policy_names_the_choices():
    with pytest.raises(ValueError, match="commit='final' is invalid: use 'on-advance' or 'final-pass'"):
        dq.enable_qvg(tiny_wan(), commit="final")
    with pytest.raises(ValueError, match="expected_frames=0 is invalid"):
        dq.CacheConfig(expected_frames=0)


@torch.no_grad()
@pytest.mark.parametrize("encode_layers", [1, 3])
def test_a_final_pass_that_stops_part_way_refuses_further_chunks_until_reset(encode_layers):
    """Alone in its group, layer 0 stored the chunk and layer 1 did not: the cache refuses to go on. In one
    group with layer 1, layer 0 stored nothing: the cache is as it was."""
    g = torch.Generator().manual_seed(1)
    rope = WanRotaryPosEmbed(D, (1, 1, 1), max_seq_len=32)
    cache = dq.QVGCache(dq.CacheConfig(**FINAL, encode_layers=encode_layers), num_layers=2)
    latent = torch.zeros(1, 1, FRAMES, HEIGHT, WIDTH)
    q, k, v = (video_like(g, 1.0)[0] for _ in range(3))
    before = cache.layout
    with cache.chunk(start_frame=0, final=True):
        rotary = cache.begin_forward(rope, latent, FRAMES, HEIGHT, WIDTH)
        cached_self_attention(cache.layers[0], q, k, v, rotary)  # layer 1 never runs
        with pytest.raises(RuntimeError, match="stopped part-way"):
            cache.begin_forward(rope, latent, FRAMES, HEIGHT, WIDTH)
    if encode_layers == 1:
        with pytest.raises(RuntimeError, match="stopped after 1 of 2 layers.*cache.reset()"):
            with cache.chunk(start_frame=0, final=True):
                pass
        cache.reset()
    else:
        assert cache.layout is before and cache.interrupted is None
        assert all(layer.storages() == [] for layer in cache.layers)
    with cache.chunk(start_frame=0, final=True):
        rotary = cache.begin_forward(rope, latent, FRAMES, HEIGHT, WIDTH)
        for layer in cache.layers:
            cached_self_attention(layer, q, k, v, rotary)
    assert [c.place for c in cache.layout.chunks] == ["recent"]


# ----------------------------------------------------------------------------------------- layer groups
def grouped_stream(encode_layers, triton=False, bad_layer=None, layers=5, chunks=4, **options):
    """A float32 tiny Wan through a sliding window with a sink, qvg-int2, ``encode_layers`` layers per
    encoder call (32 tokens per chunk): every output, and the cache. ``bad_layer``: its values are NaN in
    the third clean pass."""
    model = tiny_wan(torch.float32, num_layers=layers)
    storage = dq.QVGConfig(num_centroids=4, kmeans_iters=2, group_size=4)
    cache = dq.enable_qvg(model, storage, window_frames=8, sink_frames=2, encode_layers=encode_layers, **FINAL, **options)
    if bad_layer is not None:
        def poison(module, args, out):
            return out.fill_(float("nan")) if cache.active_final and cache.active_start == 4 else out
        model.blocks[bad_layer].attn1.to_v.register_forward_hook(poison)
    g = torch.Generator().manual_seed(3)
    text = torch.randn(1, 5, 32, generator=g)
    outs = []
    with backend("triton") if triton else nullcontext():
        for c in range(chunks):
            for t in (500.0, 0.0):
                x = torch.randn(1, 16, 2, 8, 8, generator=g)
                with cache.chunk(start_frame=2 * c, final=t == 0.0):
                    outs.append(model(x, torch.tensor([t]), text).sample)
    return outs, cache


def assert_same_stream(grouped, alone):
    (outs, cache), (expected_outs, expected) = grouped, alone
    assert all(torch.equal(a, b) for a, b in zip(outs, expected_outs))
    assert cache.layout.chunks == expected.layout.chunks
    stored, want = snapshot(cache)[2], snapshot(expected)[2]
    assert len(stored) == len(want)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(stored, want))


@torch.no_grad()
@pytest.mark.parametrize("keep_recent_chunks", [0, 1])
def test_layers_grouped_for_the_encoder_store_what_each_layer_stores_alone(keep_recent_chunks):
    """Groups of 2 and 3 layers (5 layers: a short last group) and all 5 in one call store the same bytes
    as one call per layer, so every output is the same too; packs from the recent ring slot included."""
    alone = grouped_stream(1, keep_recent_chunks=keep_recent_chunks)
    places = [c.place for c in alone[1].layout.chunks]
    assert places[0] == "sink" and "packed" in places and alone[1].layout.chunks[1].start_frame > 2  # it slid
    for size in (2, 3, 5):
        assert_same_stream(grouped_stream(size, keep_recent_chunks=keep_recent_chunks), alone)


@torch.no_grad()
def test_layers_grouped_for_the_triton_encoder_store_what_each_layer_stores_alone():
    """The same through the Triton kernels (their interpreter): 3 layers in groups of 2, one item table."""
    alone = grouped_stream(1, triton=True, layers=3, chunks=3)
    assert "packed" in [c.place for c in alone[1].layout.chunks]
    assert_same_stream(grouped_stream(2, triton=True, layers=3, chunks=3), alone)


@torch.no_grad()
def test_a_bad_layer_in_a_group_stores_only_the_layers_before_it():
    """Layer 3's values are NaN in a clean pass: layers 0-2 stored the chunk (in groups of 3, layer 3's
    group stored nothing), the error names layer 3 and the writes before it, the same as layer by layer,
    and the cache refuses to go on."""
    messages = []
    for size in (1, 3):
        with pytest.raises(ValueError, match="NaN or Inf values in layer 3's values.*stopped after 19 writes") as err:
            grouped_stream(size, bad_layer=3)  # 6 checked writes per layer: the fresh K/V, a pack, a ring slot
        messages.append(str(err.value))
    assert messages[0] == messages[1]
