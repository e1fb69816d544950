"""Prompt switches of a stream: new text from a chunk boundary on, checked and encoded before anything changes.

A switch is applied when the stream reaches its frame (``QVGStreamState.next_chunk``): with ``recache`` the
visible chunks after the sink are first stored again under the new text (LongLive's KV re-cache, through
``QVGCache.recache``), then the cross-attention takes the new text. docs/generate.md says which of
LongLive's choices (NVlabs/LongLive, ``pipeline/interactive_causal_inference.py``) this follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .pipeline_qvg_causal_wan import QVGCausalWanPipeline


@dataclass(frozen=True)
class PromptSwitch:
    """The text of the chunks from latent frame ``frame`` on; ``negative_prompt_embeds=None`` keeps the
    stream's negative text. Embeddings have the stream's shape, dtype and device."""

    frame: int
    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None
    recache: bool


@dataclass(frozen=True)
class TextSettings:
    """How the stream encodes text, so that a new prompt is encoded as its first one was."""

    guidance: bool
    num_videos_per_prompt: int
    max_sequence_length: int


def pad_text(embeds: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """Zeros after the real tokens up to ``length`` ([B, tokens, dim] -> [B, length, dim]).

    Upstream Self-Forcing's ``CausalWanModel`` pads every prompt this way before its text embedding, and
    ``WanPipeline`` pads what it encodes: the zero tokens still take attention mass in the cross-attention, so
    embeddings of different lengths give different videos unless padded the same way.
    """
    if embeds is None:
        return None
    return torch.nn.functional.pad(embeds, (0, 0, 0, length - embeds.shape[1]))


def check_switch_frame(frame: Any, frames_per_chunk: int, next_frame: int, end_frame: int | None) -> None:
    """A switch frame must be a chunk boundary the stream has not passed and will reach."""
    if not isinstance(frame, int) or isinstance(frame, bool):
        raise ValueError(f"prompt switch frame {frame!r} is invalid: use a latent frame index (an int)")
    if frame % frames_per_chunk:
        lower = frame - frame % frames_per_chunk
        raise ValueError(
            f"a prompt switch at latent frame {frame} is not on a chunk boundary: chunks start every "
            f"{frames_per_chunk} latent frames, so use {lower} or {lower + frames_per_chunk}"
        )
    if frame < next_frame:
        raise ValueError(
            f"a prompt switch at latent frame {frame} is in the past: the next chunk starts at latent frame "
            f"{next_frame}"
        )
    if end_frame is not None and frame >= end_frame:
        raise ValueError(
            f"a prompt switch at latent frame {frame} is never reached: the video ends at latent frame {end_frame}"
        )


def encode_switch(
    pipe: "QVGCausalWanPipeline",
    frame: int,
    *,
    prompt: str | list[str] | None,
    prompt_embeds: torch.Tensor | None,
    negative_prompt: str | list[str] | None,
    negative_prompt_embeds: torch.Tensor | None,
    recache: bool,
    like: torch.Tensor,
    settings: TextSettings,
) -> PromptSwitch:
    """Check and encode a switch at ``frame``; ``like`` is the stream's prompt embeddings [batch, tokens,
    text_dim], whose shape the new text must give (batch and text_dim as given, tokens padded as encoded)."""
    if (prompt is None) == (prompt_embeds is None):
        raise ValueError("a prompt switch takes exactly one of `prompt` and `prompt_embeds`")
    if negative_prompt is not None and negative_prompt_embeds is not None:
        raise ValueError("a prompt switch takes at most one of `negative_prompt` and `negative_prompt_embeds`")
    if not isinstance(recache, bool):
        raise ValueError(f"recache={recache!r} is invalid: use True (store the window again) or False")
    for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
        if text is not None and not (isinstance(text, str) or (isinstance(text, list) and all(isinstance(t, str) for t in text))):
            raise ValueError(f"`{name}` must be a str or a list of str, got {type(text).__name__}")
        if text is not None and (pipe.text_encoder is None or pipe.tokenizer is None):
            raise ValueError(f"this pipeline has no text encoder/tokenizer: pass `{name}_embeds` instead of `{name}`")
    batch, _, dim = like.shape
    for name, embeds in (("prompt_embeds", prompt_embeds), ("negative_prompt_embeds", negative_prompt_embeds)):
        if embeds is None:
            continue
        fits = isinstance(embeds, torch.Tensor) and embeds.dim() == 3 and (embeds.shape[0], embeds.shape[2]) == (batch, dim)
        if not fits or not 0 < embeds.shape[1] <= settings.max_sequence_length:
            shape = tuple(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
            raise ValueError(
                f"`{name}` of a prompt switch has shape {shape}; the stream's text is [{batch}, tokens, {dim}] "
                f"with 1 to {settings.max_sequence_length} tokens (max_sequence_length)"
            )
    encoded = []
    for name, text, embeds in (("prompt", prompt, prompt_embeds), ("negative_prompt", negative_prompt, negative_prompt_embeds)):
        if (text is None and embeds is None) or (name == "negative_prompt" and not settings.guidance):
            encoded.append(None)  # no negative text given, or no guidance to use it
            continue
        states, _ = pipe.encode_prompt(
            prompt=text, prompt_embeds=embeds, do_classifier_free_guidance=False,
            num_videos_per_prompt=settings.num_videos_per_prompt,
            max_sequence_length=settings.max_sequence_length, device=like.device,
        )
        states = pad_text(states, settings.max_sequence_length).to(device=like.device, dtype=like.dtype)
        if states.shape != like.shape:
            raise ValueError(
                f"`{name}` of a prompt switch encodes to shape {tuple(states.shape)} but the stream's text has "
                f"{tuple(like.shape)}; give as many prompts as the stream's first one"
            )
        encoded.append(states)
    return PromptSwitch(frame, encoded[0], encoded[1], recache)


def schedule_switches(
    pipe: "QVGCausalWanPipeline",
    prompt_switches: dict[int, str | list[str] | torch.Tensor] | None,
    *,
    frames_per_chunk: int,
    end_frame: int | None,
    like: torch.Tensor,
    settings: TextSettings,
) -> list[PromptSwitch]:
    """``prompt_switches`` (``{latent_frame: prompt or prompt_embeds}``) as switches with a re-cache each,
    every one checked and encoded before the stream starts."""
    if prompt_switches is None:
        return []
    if not isinstance(prompt_switches, dict):
        raise ValueError(
            f"prompt_switches must be a dict {{latent_frame: prompt or prompt_embeds}}, got "
            f"{type(prompt_switches).__name__}"
        )
    switches = []
    for frame, text in prompt_switches.items():
        check_switch_frame(frame, frames_per_chunk, 0, end_frame)
        embeds = text if isinstance(text, torch.Tensor) else None
        switches.append(encode_switch(
            pipe, frame, prompt=None if embeds is not None else text, prompt_embeds=embeds, negative_prompt=None,
            negative_prompt_embeds=None, recache=True, like=like, settings=settings,
        ))
    return switches
