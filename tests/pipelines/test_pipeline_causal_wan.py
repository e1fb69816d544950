"""The chunk loop end to end on the tiny causal Wan: shapes, determinism, sliding window, stream == call."""

import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from diffusers_qvg.pipelines import StreamingWanDecoder

SMALL = dict(prompt="a red fox", height=32, width=32)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def stock_processors(pipe) -> bool:
    return all(type(p) is WanAttnProcessor for p in pipe.transformer.attn_processors.values())


@pytest.mark.parametrize("kv_cache", ["bf16", "qvg-int2"])
def test_end_to_end_frames(pipe, kv_cache):
    # 160x160 px: 100 tokens per latent frame, 300 per chunk (QVG's 256 centroids need >= 256 per segment).
    # 3 chunks: the first is packed by the codec when the third starts (one recent chunk stays unpacked).
    state = pipe.stream(prompt="a red fox", height=160, width=160, num_frames=33, kv_cache=kv_cache,
                        generator=seeded(0))
    with state:
        chunks = list(state)
        report = state.cache.memory_report()
    assert [c.shape[1] for c in chunks] == [9, 12, 12]
    video = np.concatenate(chunks, axis=1)
    assert video.shape == (1, 33, 160, 160, 3) and video.dtype == np.float32
    assert np.isfinite(video).all() and video.min() >= 0.0 and video.max() <= 1.0
    assert report.cached_tokens == 900 and report.packed > 0
    assert stock_processors(pipe)


def test_same_seed_identical_different_seed_differs(pipe):
    a = pipe(**SMALL, num_frames=21, kv_cache="bf16", generator=seeded(3)).frames
    b = pipe(**SMALL, num_frames=21, kv_cache="bf16", generator=seeded(3)).frames
    c = pipe(**SMALL, num_frames=21, kv_cache="bf16", generator=seeded(4)).frames
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_default_generator_is_deterministic_and_leaves_global_rng(pipe):
    before = torch.random.get_rng_state()
    a = pipe(**SMALL, num_frames=9, kv_cache="bf16", output_type="latent").frames
    b = pipe(**SMALL, num_frames=9, kv_cache="bf16", output_type="latent").frames
    assert torch.equal(a, b)
    assert torch.equal(before, torch.random.get_rng_state())


def test_stream_yields_the_frames_of_call(pipe):
    video = pipe(**SMALL, num_frames=33, kv_cache="bf16", generator=seeded(5)).frames
    with pipe.stream(**SMALL, num_frames=33, kv_cache="bf16", generator=seeded(5)) as state:
        chunks = list(state)
    assert [c.shape[1] for c in chunks] == [9, 12, 12]
    assert np.array_equal(np.concatenate(chunks, axis=1), video)


def test_streaming_decoder_equals_whole_video_decode(pipe):
    latents = pipe(**SMALL, num_frames=33, kv_cache="bf16", generator=seeded(6), output_type="latent").frames
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        whole = vae.decode(latents * std + mean).sample
    decoder = StreamingWanDecoder(vae)
    streamed = torch.cat([decoder.decode(latents[:, :, i : i + 3]) for i in range(0, latents.shape[2], 3)], dim=2)
    assert streamed.shape == whole.shape == (1, 3, 33, 32, 32)
    torch.testing.assert_close(streamed, whole, rtol=0, atol=1e-6)


def test_video_twice_the_window_keeps_cache_memory_flat(pipe):
    # window of 9 latent frames (sink 3 + 2 chunks); 21 latent frames = 7 chunks, > 2x the window.
    reports = []
    with pipe.stream(**SMALL, num_frames=81, kv_cache="bf16", window_frames=9, sink_frames=3, generator=seeded(7),
                     output_type="latent") as state:
        for latents in state:
            assert torch.isfinite(latents).all()
            reports.append(state.cache.memory_report())
    assert len(reports) == 7
    full = reports[2]  # the window (9 frames) is full once the third chunk is written
    # between chunks the cache holds what the next chunk sees beside itself: the sink and the newest chunk
    assert full.cached_tokens == (3 + 3) * 4
    assert all(r == full for r in reports[2:])
    assert reports[0].cached_tokens < reports[1].cached_tokens == full.cached_tokens


def test_keep_recent_chunks_changes_the_cache_not_the_frames(pipe):
    """Only clean-context passes are stored (no slot for the chunk being denoised), in a pool sized for the
    video; with a lossless storage, where a finished chunk lives cannot change the video."""
    videos, reports = [], []
    for keep in (1, 0):
        with pipe.stream(**SMALL, num_frames=33, kv_cache="bf16", keep_recent_chunks=keep, generator=seeded(10),
                         output_type="latent") as state:
            videos.append(torch.cat(list(state), dim=2))
            reports.append(state.cache.memory_report())
            assert state.cache.config.commit == "final-pass"
    assert torch.equal(*videos)
    one, zero = reports
    assert one.current == zero.current == 0 and zero.recent == 0 < one.recent
    assert one.cached_tokens == zero.cached_tokens == 3 * 3 * 4
    # every stored byte holds a cached token: "bf16" storage keeps the float32 model's dtype, 2x BF16's bytes
    assert one.cache == zero.cache == 2 * zero.bf16_equivalent


def test_stream_continue_reset_and_close(pipe):
    generator = seeded(8)
    state = pipe.stream(**SMALL, num_frames=None, kv_cache="bf16", generator=generator)
    first = [state.next_chunk() for _ in range(2)]
    assert state.start_frame == 6 and not state.done
    state.reset()
    generator.manual_seed(8)
    again = [state.next_chunk() for _ in range(2)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    state.close()
    assert stock_processors(pipe)
    with pytest.raises(RuntimeError, match="closed"):
        state.next_chunk()


def test_new_stream_closes_the_previous_one(pipe):
    old = pipe.stream(**SMALL, num_frames=9, kv_cache="bf16")
    new = pipe.stream(**SMALL, num_frames=9, kv_cache="bf16")
    assert old.closed and not new.closed
    new.close()
    assert stock_processors(pipe)


def test_classifier_free_guidance_runs_both_branches_in_one_cache(pipe):
    plain = pipe(**SMALL, num_frames=21, kv_cache="bf16", generator=seeded(9), output_type="latent").frames
    guided = pipe(**SMALL, negative_prompt="blurry", num_frames=21, kv_cache="bf16", guidance_scale=3.0,
                  generator=seeded(9), output_type="latent").frames
    assert guided.shape == plain.shape and torch.isfinite(guided).all()
    assert not torch.equal(guided, plain)


def test_callback_sees_every_step_and_can_edit_latents(pipe):
    seen = []

    def callback(p, step, timestep, kwargs):
        seen.append((step, float(timestep)))
        return {"latents": torch.zeros_like(kwargs["latents"])}

    latents = pipe(**SMALL, num_frames=21, kv_cache="bf16", output_type="latent", callback_on_step_end=callback).frames
    assert [s for s, _ in seen] == list(range(8))
    # 1000, 750, 500, 250 warped with shift 5: sigma' = 5 s / (1 + 4 s)
    expected = [1000 * 5 * s / (1 + 4 * s) for s in (1.0, 0.75, 0.5, 0.25)]
    assert [t for _, t in seen[:4]] == pytest.approx(expected, rel=1e-6)
    assert torch.count_nonzero(latents) == 0


def test_plain_bf16_cache_stores_rotated_keys_and_gives_the_same_video(pipe):
    """``keys_before_rope=False`` (Self-Forcing's layout, nothing rotated on read: bench_e2e's plain anchor)
    changes where keys are rotated, not the video."""
    def video(**kwargs):
        with pipe.stream(**SMALL, num_frames=33, kv_cache="bf16", output_type="latent", generator=seeded(2),
                         **kwargs) as state:
            assert state.cache.config.keys_before_rope == kwargs.get("keys_before_rope", True)
            return torch.cat(list(state), dim=2)

    assert torch.equal(video(), video(keys_before_rope=False))


def test_short_prompt_embeds_are_zero_padded_as_upstream(pipe):
    """Self-Forcing pads the text with zeros to 512 tokens inside its model: the same embeddings, padded by
    the caller or not, give the same video (both branches of classifier-free guidance, over two chunks)."""
    g = seeded(0)
    text, negative = torch.randn(1, 7, 32, generator=g), torch.randn(1, 3, 32, generator=g)

    def video(prompt_embeds, negative_prompt_embeds, **kwargs):
        return pipe(prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds, height=32, width=32,
                    num_frames=21, kv_cache="bf16", guidance_scale=3.0, output_type="latent", generator=seeded(1),
                    **kwargs).frames

    def padded(x):
        return torch.cat([x, torch.zeros(1, 512 - x.shape[1], 32)], dim=1)

    assert torch.equal(video(text, negative), video(padded(text), padded(negative)))
    assert not torch.equal(video(text, negative), video(text, negative, max_sequence_length=256))  # zeros count


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_frames=80), r"num_frames=80 is not reachable.*nearest: 69 or 81"),
        (dict(num_frames=5), r"num_frames=5 is not reachable.*nearest: 9"),
        (dict(kv_cache="int3"), r"unknown KV cache storage 'int3'"),
        (dict(height=40), r"multiples of 16"),
        (dict(output_type="gif"), r"output_type='gif' is invalid"),
        (dict(callback_on_step_end_tensor_inputs=["noise"]), r"\['noise'\] are not in"),
        (dict(window_frames=3, sink_frames=3), r"window_frames=3 leaves no room"),
        (dict(frames_per_chunk=0), r"frames_per_chunk=0 is invalid"),
        (dict(keep_recent_chunks=-1), r"keep_recent_chunks=-1 is invalid"),
        (dict(denoising_timesteps=(1000, 0)), r"denoising_timesteps=\(1000, 0\) must be"),
        (dict(prompt=None), r"exactly one of `prompt` and `prompt_embeds`"),
        (dict(prompt=None, prompt_embeds=torch.zeros(1, 513, 32)),
         r"`prompt_embeds` has 513 tokens, more than max_sequence_length=512"),
        (dict(negative_prompt_embeds=torch.zeros(1, 20, 32), max_sequence_length=16, guidance_scale=2.0),
         r"`negative_prompt_embeds` has 20 tokens, more than max_sequence_length=16"),
        (dict(prompt=None, prompt_embeds=torch.zeros(1, 8, 31)),
         r"`prompt_embeds` has shape \(1, 8, 31\); it must be \[batch, tokens, 32\]"),
    ],
)
def test_bad_inputs_raise_before_any_state_changes(pipe, kwargs, match):
    args = dict(SMALL, num_frames=9, kv_cache="bf16") | kwargs
    with pytest.raises(ValueError, match=match):
        pipe(**args)
    assert stock_processors(pipe)
    assert pipe._live_stream is None


@torch.no_grad()
def test_a_compiled_pipeline_matches_eager_and_reuses_its_graphs_across_videos():
    from torch._dynamo.testing import CompileCounterWithBackend

    from diffusers_qvg.pipelines import QVGCausalWanPipeline, tiny_components

    torch._dynamo.reset()
    eager, compiled = (QVGCausalWanPipeline(**tiny_components(seed=0)) for _ in range(2))
    for p in (eager, compiled):
        p.set_progress_bar_config(disable=True)
    counter = CompileCounterWithBackend("aot_eager")
    compiled.compile_transformer(backend=counter)
    settings = dict(**SMALL, num_frames=33, kv_cache="bf16", window_frames=6, output_type="latent")
    counts = []
    for seed, switches in ((0, None), (1, {6: "a blue whale"})):  # a prompt switch re-caches by clean passes
        video = compiled(**settings, generator=seeded(seed), prompt_switches=switches).frames
        assert torch.equal(video, eager(**settings, generator=seeded(seed), prompt_switches=switches).frames)
        counts.append(counter.frame_count)
    assert counts[0] == counts[1] <= 4  # the second video, and its re-cache, compile nothing
    assert compiled._kept_cache is not None and not stock_processors(compiled)  # kept installed, emptied
    assert compiled._kept_cache.layout.chunks == [] and stock_processors(eager)
    torch._dynamo.reset()
