"""Autoregressive (Self-Forcing / CausVid / LongLive) text-to-video with Wan components and a QVG KV cache."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKLWan, DiffusionPipeline, FlowMatchLCMScheduler, WanPipeline, WanTransformer3DModel
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.utils import logging, replace_example_docstring
from diffusers.video_processor import VideoProcessor
from transformers import AutoTokenizer, UMT5EncoderModel

from diffusers_qvg import CacheConfig, QVGCache, disable_qvg, enable_qvg, resolve_codec

from .prompt_switch import TextSettings, pad_text, schedule_switches
from .random_models import self_forcing_scheduler
from .stream_state import QVGStreamState

logger = logging.get_logger(__name__)

OUTPUT_TYPES = ("np", "pt", "pil", "latent")

EXAMPLE_DOC_STRING = """
    Examples:
        ```py
        >>> import torch
        >>> from diffusers.utils import export_to_video
        >>> from diffusers_qvg.pipelines import QVGCausalWanPipeline, load_causal_wan_transformer

        >>> base = "Wan2.1-T2V-1.3B-Diffusers"  # the base model, diffusers layout
        >>> transformer = load_causal_wan_transformer("self_forcing_dmd.pt", base, torch_dtype=torch.bfloat16)
        >>> pipe = QVGCausalWanPipeline.from_pretrained(base, transformer=transformer, torch_dtype=torch.bfloat16)
        >>> pipe.to("cuda")
        >>> video = pipe("a corgi surfing a wave", num_frames=81, kv_cache="qvg-int2").frames[0]
        >>> export_to_video(video, "corgi.mp4", fps=16)
        ```
"""


class QVGCausalWanPipeline(DiffusionPipeline):
    r"""
    Chunk-by-chunk text-to-video for causal Wan models, the KV cache stored by ``diffusers_qvg``.

    Components are ``WanPipeline``'s; the scheduler is Self-Forcing's few-step sampler
    (``FlowMatchLCMScheduler(shift=5)``: x0 prediction, then re-noising to the next sigma). ``tokenizer`` and
    ``text_encoder`` may be omitted when ``prompt_embeds`` are given. Example: see :meth:`__call__`.
    """

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    _optional_components = ["tokenizer", "text_encoder"]
    _callback_tensor_inputs = ["latents", "prompt_embeds", "negative_prompt_embeds"]

    # Text encoding is WanPipeline's own (UMT5, padded to max_sequence_length).
    encode_prompt = WanPipeline.encode_prompt
    _get_t5_prompt_embeds = WanPipeline._get_t5_prompt_embeds

    def __init__(
        self,
        tokenizer: AutoTokenizer | None,
        text_encoder: UMT5EncoderModel | None,
        vae: AutoencoderKLWan,
        scheduler: FlowMatchLCMScheduler,
        transformer: WanTransformer3DModel,
    ):
        super().__init__()
        self.register_modules(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
        )
        self.vae_scale_factor_temporal = self.vae.config.scale_factor_temporal
        self.vae_scale_factor_spatial = self.vae.config.scale_factor_spatial
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)
        self._live_stream: QVGStreamState | None = None  # the open stream, owner of the transformer's cache
        self._kept_cache: QVGCache | None = None  # installed across videos once the transformer is compiled
        self._keep_cache = False

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs):
        """Load from a diffusers folder; a Wan base folder (``WanPipeline`` layout) works as it is.

        Its UniPC scheduler is replaced by Self-Forcing's sampler unless ``scheduler=`` is given; pass the
        causal generator as ``transformer=load_causal_wan_transformer(checkpoint, base_folder)``.
        """
        if "scheduler" not in kwargs and _stored_scheduler(pretrained_model_name_or_path) != "FlowMatchLCMScheduler":
            kwargs["scheduler"] = self_forcing_scheduler()
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    # ----------------------------------------------------------------------------------------- checks
    def latent_frames_for(self, num_frames: int, frames_per_chunk: int) -> int:
        """Latent frames of a ``num_frames`` video; it must be ``1 + t (L - 1)`` with ``L`` whole chunks."""
        t = self.vae_scale_factor_temporal
        if not isinstance(frames_per_chunk, int) or frames_per_chunk < 1:
            raise ValueError(f"frames_per_chunk={frames_per_chunk!r} is invalid: use a positive number of latent frames")
        step = t * frames_per_chunk
        first = 1 + t * (frames_per_chunk - 1)
        if not isinstance(num_frames, int) or num_frames < first or (num_frames - first) % step:
            lower = first + max(0, (num_frames - first) // step) * step if isinstance(num_frames, int) else first
            nearest = f"{lower}" if isinstance(num_frames, int) and num_frames < first else f"{lower} or {lower + step}"
            raise ValueError(
                f"num_frames={num_frames!r} is not reachable: a video has 1 + {t} * (latent frames - 1) frames and "
                f"latent frames come in chunks of {frames_per_chunk}, so num_frames must be {first} + {step} * k "
                f"({first}, {first + step}, {first + 2 * step}, ...); nearest: {nearest}"
            )
        return (num_frames - 1) // t + 1

    def check_inputs(self, prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, height, width,
                     guidance_scale, output_type, callback_on_step_end_tensor_inputs, max_sequence_length) -> None:
        multiple = self.vae_scale_factor_spatial * self.transformer.config.patch_size[1]
        if height % multiple or width % multiple or height <= 0 or width <= 0:
            raise ValueError(f"height and width must be positive multiples of {multiple}; got {height}x{width}")
        if (prompt is None) == (prompt_embeds is None):
            raise ValueError("pass exactly one of `prompt` and `prompt_embeds`")
        if prompt is not None and not isinstance(prompt, (str, list)):
            raise ValueError(f"`prompt` must be a str or a list of str, got {type(prompt).__name__}")
        if negative_prompt is not None and negative_prompt_embeds is not None:
            raise ValueError("pass at most one of `negative_prompt` and `negative_prompt_embeds`")
        if prompt is not None and (self.text_encoder is None or self.tokenizer is None):
            raise ValueError("this pipeline has no text encoder/tokenizer: pass `prompt_embeds` instead of `prompt`")
        if guidance_scale > 1.0 and prompt_embeds is not None and negative_prompt_embeds is None and self.text_encoder is None:
            raise ValueError("guidance_scale > 1 without a text encoder needs `negative_prompt_embeds`")
        text_dim = self.transformer.config.text_dim
        for name, embeds in (("prompt_embeds", prompt_embeds), ("negative_prompt_embeds", negative_prompt_embeds)):
            if embeds is None:
                continue
            if embeds.dim() != 3 or embeds.shape[2] != text_dim:
                raise ValueError(f"`{name}` has shape {tuple(embeds.shape)}; it must be [batch, tokens, {text_dim}] "
                                 f"(the transformer's text_dim)")
            if embeds.shape[1] > max_sequence_length:
                raise ValueError(
                    f"`{name}` has {embeds.shape[1]} tokens, more than max_sequence_length={max_sequence_length}; "
                    f"pass at most {max_sequence_length} tokens (the real ones: shorter embeddings are zero-padded) "
                    "or raise max_sequence_length"
                )
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type={output_type!r} is invalid: use one of {list(OUTPUT_TYPES)}")
        unknown = [k for k in callback_on_step_end_tensor_inputs if k not in self._callback_tensor_inputs]
        if unknown:
            raise ValueError(f"callback_on_step_end_tensor_inputs {unknown} are not in {self._callback_tensor_inputs}")

    # ----------------------------------------------------------------------------------------- streaming
    @torch.no_grad()
    def stream(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        height: int = 480,
        width: int = 832,
        num_frames: int | None = None,
        kv_cache: Any = "qvg-int2",
        window_frames: int | None = None,
        sink_frames: int = 0,
        keep_recent_chunks: int = 0,
        keys_before_rope: bool = True,
        frames_per_chunk: int = 3,
        denoising_timesteps: tuple[float, ...] = (1000, 750, 500, 250),
        context_noise: float = 0.0,
        guidance_scale: float = 1.0,
        num_videos_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        output_type: str = "np",
        callback_on_step_end: Callable | PipelineCallback | MultiPipelineCallbacks | None = None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],
        max_sequence_length: int = 512,
        prompt_switches: dict[int, str | list[str] | torch.Tensor] | None = None,
    ) -> QVGStreamState:
        r"""
        Start a video and return its :class:`QVGStreamState`; iterating it yields each chunk's frames as soon as
        they are decoded (``np``: [B, T, H, W, 3]). ``num_frames=None`` streams without end (``break`` out).

        Args: as :meth:`__call__`. The state owns the KV cache: keep it to continue, switch its prompt
        (``set_prompt``), ``reset()`` it, and ``close()`` it (or use it in a ``with`` block) to restore the
        transformer's stock processors.
        """
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        self.check_inputs(prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, height, width,
                          guidance_scale, output_type, callback_on_step_end_tensor_inputs, max_sequence_length)
        num_chunks = None
        if num_frames is not None:
            num_chunks = self.latent_frames_for(num_frames, frames_per_chunk) // frames_per_chunk
        resolve_codec(kv_cache)  # an unknown storage name fails here, before anything is encoded or installed
        if not denoising_timesteps or any(not 0 < t <= self.scheduler.config.num_train_timesteps for t in denoising_timesteps):
            raise ValueError(f"denoising_timesteps={denoising_timesteps!r} must be non-empty, each in (0, "
                             f"{self.scheduler.config.num_train_timesteps}]")

        device = self._execution_device
        prompt_embeds, negative_prompt_embeds = self.encode_prompt(
            prompt=prompt, negative_prompt=negative_prompt, do_classifier_free_guidance=guidance_scale > 1.0,
            num_videos_per_prompt=num_videos_per_prompt, prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds, max_sequence_length=max_sequence_length, device=device,
        )
        prompt_embeds = pad_text(prompt_embeds, max_sequence_length)
        negative_prompt_embeds = pad_text(negative_prompt_embeds, max_sequence_length)
        dtype = self.transformer.dtype
        batch = prompt_embeds.shape[0]
        latent_shape = (batch, self.transformer.config.in_channels, frames_per_chunk,
                        height // self.vae_scale_factor_spatial, width // self.vae_scale_factor_spatial)
        text_settings = TextSettings(guidance_scale > 1.0, num_videos_per_prompt, max_sequence_length)
        switches = schedule_switches(self, prompt_switches, frames_per_chunk=frames_per_chunk,
                                     end_frame=None if num_chunks is None else num_chunks * frames_per_chunk,
                                     like=prompt_embeds.to(dtype), settings=text_settings)
        if generator is None:
            generator = torch.Generator().manual_seed(0)  # deterministic by default; never the global RNG
        if self._live_stream is not None:
            logger.warning("closing the previous stream of this pipeline: one transformer holds one KV cache")
            self._live_stream.close()
        state = QVGStreamState(
            self,
            prompt_embeds=prompt_embeds.to(dtype),
            negative_prompt_embeds=None if negative_prompt_embeds is None else negative_prompt_embeds.to(dtype),
            kv_cache=kv_cache,
            window_frames=window_frames,
            sink_frames=sink_frames,
            keep_recent_chunks=keep_recent_chunks,
            keys_before_rope=keys_before_rope,
            latent_shape=latent_shape,
            num_chunks=num_chunks,
            guidance_scale=guidance_scale,
            context_noise=context_noise,
            sigmas=[t / self.scheduler.config.num_train_timesteps for t in denoising_timesteps],
            generator=generator,
            output_type=output_type,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            text_settings=text_settings,
            prompt_switches=switches,
        )
        self._live_stream = state
        return state

    def _release_stream(self, state: QVGStreamState) -> None:
        if self._live_stream is state:
            self._live_stream = None

    # ----------------------------------------------------------------------------------------- compile
    def compile_transformer(self, **compile_kwargs) -> None:
        """Compile the transformer in place (``torch.compile``, ``fullgraph=True`` unless told otherwise) for
        chunk-by-chunk generation, and keep one KV cache installed from one video to the next.

        A compiled forward holds tensor work only: the pipeline plans each chunk before its forward, and the
        cache's reads and writes are opaque ops. The first two chunks of the first video compile (a
        denoising and a clean-context graph, then both again with the window length dynamic), minutes for
        a 30-layer model; later chunks and videos with the same settings reuse the graphs. Pass
        ``mode="reduce-overhead"`` for CUDA graphs (see docs/generate.md for what they capture).
        """
        compile_kwargs.setdefault("fullgraph", True)
        self.transformer.compile(**compile_kwargs)
        self._keep_cache = True

    def _install_cache(self, storage: Any, **options) -> QVGCache:
        """The stream's cache: a new one on the transformer, or, once compiled, the kept one reset for
        these settings (a new cache would re-hook the transformer and recompile it)."""
        if self._kept_cache is not None:
            self._kept_cache.reset(CacheConfig(storage=storage, **options))
            return self._kept_cache
        cache = enable_qvg(self.transformer, storage, **options)
        if self._keep_cache:
            self._kept_cache = cache
        return cache

    def _uninstall_cache(self, cache: QVGCache) -> None:
        """A stream is done with ``cache``: stock processors back, or (compiled) the cache kept, emptied."""
        if cache is self._kept_cache:
            cache.reset()
        else:
            disable_qvg(self.transformer)

    # ----------------------------------------------------------------------------------------- call
    @torch.no_grad()
    @replace_example_docstring(EXAMPLE_DOC_STRING)
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        kv_cache: Any = "qvg-int2",
        window_frames: int | None = None,
        sink_frames: int = 0,
        keep_recent_chunks: int = 0,
        keys_before_rope: bool = True,
        frames_per_chunk: int = 3,
        denoising_timesteps: tuple[float, ...] = (1000, 750, 500, 250),
        context_noise: float = 0.0,
        guidance_scale: float = 1.0,
        num_videos_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        callback_on_step_end: Callable | PipelineCallback | MultiPipelineCallbacks | None = None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],
        max_sequence_length: int = 512,
        prompt_switches: dict[int, str | list[str] | torch.Tensor] | None = None,
    ) -> WanPipelineOutput | tuple:
        r"""
        Generate a whole video chunk by chunk (the frames :meth:`stream` yields, concatenated).

        Args:
            prompt / negative_prompt: text (``negative_prompt`` only matters with ``guidance_scale > 1``).
            height, width: pixels, multiples of 16.
            num_frames: ``1 + 4 * (3k - 1)`` for chunks of 3 latent frames (9, 21, ..., 81, ...), any length:
                beyond ``window_frames`` the cache slides, its first ``sink_frames`` pinned.
            kv_cache: storage of the packed history, ``"bf16"``, ``"qvg-int2"``, ``"qvg-int4"``,
                ``"kivi-int2"``, ``"nvfp4"`` (LongLive-2's) or a codec config such as ``diffusers_qvg.QVGConfig(...)``.
            window_frames: latent frames attended to (counting the sink and the chunk); ``None``: all.
            sink_frames: first latent frames never evicted (LongLive uses 3 with a window of 12).
            keep_recent_chunks: finished chunks kept unquantized before they are packed (0: every chunk is
                packed at its clean-context pass, the smallest cache, 7.1x below BF16 with "qvg-int2"; 1 cuts
                the attention error on video-derived K/V by ~20% for ~1.9x more cache memory at 21 frames).
                The chunk being denoised is never stored.
            keys_before_rope: store keys before RoPE and rotate them as they are read (QVG clusters them far
                better: ~25% less key error); ``False`` stores rotated keys, as Self-Forcing's own cache does, so
                ``kv_cache="bf16", keys_before_rope=False`` is the plain BF16 cache (nothing rotated on read).
            frames_per_chunk: latent frames per chunk (Self-Forcing: 3).
            denoising_timesteps: before the shift-5 warp (Self-Forcing: 1000, 750, 500, 250).
            context_noise: timestep of the forward that writes a finished chunk's clean K/V (0).
            guidance_scale: CFG when > 1, both branches in one batch over one cache (distilled
                Self-Forcing/CausVid models need none: 1.0).
            generator: seeds the initial noise of each chunk and every re-noising (default: seed 0).
            prompt_embeds / negative_prompt_embeds: text-encoder states [batch, tokens, text_dim] instead of
                ``prompt`` / ``negative_prompt``. Shorter than ``max_sequence_length``, they are zero-padded after
                their tokens, as upstream Self-Forcing pads the text inside its model and as the pipeline pads
                the text it encodes, so the same embeddings give the same video padded or not; longer ones raise.
            output_type: ``"np"``, ``"pt"``, ``"pil"`` or ``"latent"``.
            callback_on_step_end: called after every denoising step as ``(pipe, step, timestep, kwargs)``;
                ``step`` counts across chunks.
            max_sequence_length: text tokens the transformer attends to (UMT5: 512, Wan's and Self-Forcing's).
            prompt_switches: ``{latent_frame: prompt or prompt_embeds}``, each frame a chunk boundary: from that
                chunk on the video follows the new prompt, the visible chunks after the sink stored again under
                it first (LongLive's KV re-cache; ``QVGStreamState.set_prompt`` is the interactive form).

        Examples:
        """
        state = self.stream(
            prompt=prompt, negative_prompt=negative_prompt, height=height, width=width, num_frames=num_frames,
            kv_cache=kv_cache, window_frames=window_frames, sink_frames=sink_frames,
            keep_recent_chunks=keep_recent_chunks, keys_before_rope=keys_before_rope, frames_per_chunk=frames_per_chunk,
            denoising_timesteps=denoising_timesteps,
            context_noise=context_noise, guidance_scale=guidance_scale,
            num_videos_per_prompt=num_videos_per_prompt, generator=generator, prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds, output_type=output_type,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            max_sequence_length=max_sequence_length, prompt_switches=prompt_switches,
        )
        with state:
            video = concat_chunks(list(state), output_type)
        self.maybe_free_model_hooks()
        return WanPipelineOutput(frames=video) if return_dict else (video,)


def concat_chunks(chunks: list[Any], output_type: str) -> Any:
    """Join per-chunk outputs along time (latents: [B, C, F, h, w]; frames: [B, T, ...] or lists of images)."""
    if output_type == "latent":
        return torch.cat(chunks, dim=2)
    if output_type == "pt":
        return torch.cat(chunks, dim=1)
    if output_type == "np":
        return np.concatenate(chunks, axis=1)
    return [sum((chunk[b] for chunk in chunks), []) for b in range(len(chunks[0]))]


def _stored_scheduler(path: str | os.PathLike) -> str | None:
    index = os.path.join(os.fspath(path), "model_index.json")
    if not os.path.isfile(index):
        return None
    with open(index) as f:
        entry = json.load(f).get("scheduler")
    return entry[1] if isinstance(entry, list) and len(entry) == 2 else None
