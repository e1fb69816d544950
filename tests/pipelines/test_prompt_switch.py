"""Prompt switches on the tiny causal Wan: set_prompt and the prompt_switches schedule, with and without the
KV re-cache, and their refusals (all before anything changes)."""

import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

import diffusers_qvg as dq

# LongLive's window: 12 latent frames, the first 3 a sink. Chunks of 3 frames: after chunk 2 the window holds
# the sink and chunks 1-2; the clean-context pass of chunk 3 (frames 9-11) evicts chunk 1, the first slide.
STREAM = dict(prompt="a red fox", height=32, width=32, num_frames=1 + 4 * (15 - 1), window_frames=12, sink_frames=3,
              output_type="latent")
BEFORE_SLIDE, AFTER_SLIDE = 3, 4  # chunk indices (frames 9 and 12)
QVG = dq.QVGConfig(num_centroids=8)  # qvg-int2 with 8 centroids: a chunk has 12 tokens


def video(pipe, switch=None, kv_cache="bf16", seed=1, **options):
    """The latents of every chunk; ``switch(state, chunk_index)`` runs before each chunk."""
    chunks = []
    with pipe.stream(**(STREAM | options), kv_cache=kv_cache, generator=torch.Generator().manual_seed(seed)) as state:
        for c in range(state.num_chunks):
            if switch is not None:
                switch(state, c)
            chunks.append(state.next_chunk())
    return torch.cat(chunks, dim=2)


def switch_at(chunk, **kwargs):
    return lambda state, c: state.set_prompt(**kwargs) if c == chunk else None


def encoded(pipe, prompt):
    with torch.no_grad():
        return pipe.encode_prompt(prompt=prompt, do_classifier_free_guidance=False, max_sequence_length=512)[0]


@pytest.mark.parametrize(
    "kv_cache, guidance_scale", [("bf16", 1.0), (QVG, 1.0), ("bf16", 3.0)], ids=["bf16", "qvg-int2", "bf16-cfg"]
)
def test_the_same_prompt_recached_before_the_window_slid_changes_nothing(pipe, kv_cache, guidance_scale):
    """The re-cache recomputes the same K/V from the same clean latents over the same context; once chunks
    have left the window, a re-cached chunk sees less than it did and the video may change."""
    cfg = dict(guidance_scale=guidance_scale, negative_prompt="blurry") if guidance_scale > 1 else {}
    plain = video(pipe, kv_cache=kv_cache, **cfg)
    same = video(pipe, switch_at(BEFORE_SLIDE, prompt="a red fox"), kv_cache=kv_cache, **cfg)
    assert torch.equal(same, plain)
    later = video(pipe, switch_at(AFTER_SLIDE, prompt="a red fox"), kv_cache=kv_cache, **cfg)
    assert torch.equal(later[:, :, :12], plain[:, :, :12]) and not torch.equal(later, plain)


def test_a_switch_without_recache_changes_only_the_cross_attention_text(pipe):
    new = encoded(pipe, "a blue whale")

    def swap_text(state, c):  # what the cross-attention reads, and nothing else
        if c == BEFORE_SLIDE:
            state.prompt_embeds = new

    kept = video(pipe, switch_at(BEFORE_SLIDE, prompt="a blue whale", recache=False))
    assert torch.equal(kept, video(pipe, swap_text))
    recached = video(pipe, switch_at(BEFORE_SLIDE, prompt="a blue whale"))
    plain = video(pipe)
    assert torch.equal(recached[:, :, :9], plain[:, :, :9])  # nothing changes before the switch
    assert not torch.equal(recached[:, :, 9:], kept[:, :, 9:])  # the re-cached window steers the chunks after it


def test_a_schedule_is_set_prompt_at_its_frames_and_reset_replays_it(pipe):
    embeds = encoded(pipe, "a green owl")
    scheduled = pipe(**STREAM, kv_cache="bf16", generator=torch.Generator().manual_seed(1),
                     prompt_switches={6: "a blue whale", 12: embeds}).frames

    def switches(state, c):
        if c == 0:
            state.set_prompt(prompt_embeds=embeds, at_frame=12)
        if c == 2:
            state.set_prompt(prompt="a blue whale")

    assert torch.equal(scheduled, video(pipe, switches))
    generator = torch.Generator().manual_seed(1)
    with pipe.stream(**STREAM, kv_cache="bf16", generator=generator, prompt_switches={6: "a blue whale", 12: embeds}) as state:
        first = []
        for chunk in state:
            first.append(chunk)
            # the clean latents of the chunks a re-cache would store again, no more
            assert sorted(state.clean_latents) == [start for start, _ in state.cache.recache_chunks()]
        state.reset()
        generator.manual_seed(1)
        assert torch.equal(torch.cat(list(state), dim=2), torch.cat(first, dim=2)) and torch.equal(torch.cat(first, dim=2), scheduled)
    assert state.clean_latents == {}


def test_bad_switches_raise_before_anything_changes(pipe):
    def misuse(state, c):
        if c != 2:
            return
        good = state.prompt_embeds
        calls = [
            (dict(prompt="x", prompt_embeds=good), "exactly one of `prompt` and `prompt_embeds`"),
            (dict(), "exactly one of `prompt` and `prompt_embeds`"),
            (dict(prompt_embeds=good[..., :31]), r"shape \(1, 512, 31\); the stream's text is \[1, tokens, 32\]"),
            (dict(prompt_embeds=torch.cat([good, good])), r"shape \(2, 512, 32\)"),
            (dict(prompt="x", at_frame=10), "latent frame 10 is not on a chunk boundary.*use 9 or 12"),
            (dict(prompt="x", at_frame=3), "latent frame 3 is in the past: the next chunk starts at latent frame 6"),
            (dict(prompt="x", at_frame=15), "latent frame 15 is never reached: the video ends at latent frame 15"),
            (dict(prompt="x", recache="yes"), "recache='yes' is invalid"),
            (dict(prompt=3), "`prompt` must be a str or a list of str"),
            (dict(prompt="x", negative_prompt="y", negative_prompt_embeds=good), "at most one of `negative_prompt`"),
        ]
        for kwargs, match in calls:
            with pytest.raises(ValueError, match=match):
                state.set_prompt(**kwargs)
            assert state.switches == {} and state.prompt_embeds is good

    assert torch.equal(video(pipe, misuse), video(pipe))


@pytest.mark.parametrize(
    "switches, match",
    [
        ({10: "a blue whale"}, "latent frame 10 is not on a chunk boundary"),
        ({-3: "a blue whale"}, "latent frame -3 is in the past"),
        ({18: "a blue whale"}, "latent frame 18 is never reached"),
        ({9: 5}, "`prompt` must be a str or a list of str"),
        ({9: torch.zeros(1, 512, 31)}, r"shape \(1, 512, 31\)"),
        ([(9, "a blue whale")], "prompt_switches must be a dict"),
    ],
)
def test_a_bad_schedule_raises_before_the_stream_starts(pipe, switches, match):
    previous = pipe.stream(**STREAM, kv_cache="bf16")
    with pytest.raises(ValueError, match=match):
        pipe.stream(**STREAM, kv_cache="bf16", prompt_switches=switches)
    assert pipe._live_stream is previous and not previous.closed  # the open stream was not closed
    previous.close()
    assert all(type(p) is WanAttnProcessor for p in pipe.transformer.attn_processors.values())


def test_frames_follow_the_switch_in_pixels_too(pipe):
    """np output: the same switch through the decoder (the stream keeps latents of its own)."""
    options = dict(output_type="np", num_frames=1 + 4 * (12 - 1))
    with pipe.stream(**(STREAM | options), kv_cache="bf16", generator=torch.Generator().manual_seed(1)) as state:
        frames = [state.next_chunk() for _ in range(2)]
        state.set_prompt(prompt="a red fox")
        frames += list(state)
    assert np.array_equal(np.concatenate(frames, axis=1), pipe(**(STREAM | options), kv_cache="bf16",
                                                               generator=torch.Generator().manual_seed(1)).frames)

