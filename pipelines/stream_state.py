"""One autoregressive video in progress: its KV cache, its noise generator, its decoder state, its position.

The chunk loop of Self-Forcing (``pipeline/causal_inference.py``), written for diffusers: per chunk of
``frames_per_chunk`` latent frames, fresh noise is denoised by a few forwards (x0 prediction, then re-noising
to the next sigma: ``FlowMatchLCMScheduler.step``), then one more forward at ``context_noise`` on the clean x0
writes the chunk's final K/V into the cache, and the chunk is decoded. The cache runs with
``commit="final-pass"``: the denoising forwards (``cache.chunk(start_frame=f)``) attend to the cache and to
their own K/V but store nothing; the clean-context pass (``cache.chunk(start_frame=f, final=True)``) stores the
chunk straight into its final place, so no BF16 slot is held for the chunk being denoised.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from .streaming_decoder import StreamingWanDecoder

if TYPE_CHECKING:
    from .pipeline_qvg_causal_wan import QVGCausalWanPipeline


class QVGStreamState:
    """Owns the cache of one video; iterate it for each chunk's frames (see ``QVGCausalWanPipeline.stream``).

    Keep it to continue the video later (``next_chunk()`` or iterate again), ``reset()`` it to start a new
    video with the same prompt and settings (the cache and the decoder are emptied, the generator is not
    reseeded), and ``close()`` it (or use ``with``) to give the transformer its stock processors back.
    """

    def __init__(
        self,
        pipe: "QVGCausalWanPipeline",
        *,
        prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None,
        kv_cache: Any,
        window_frames: int | None,
        sink_frames: int,
        keep_recent_chunks: int,
        keys_before_rope: bool,
        latent_shape: tuple[int, int, int, int, int],
        num_chunks: int | None,
        guidance_scale: float,
        context_noise: float,
        sigmas: list[float],
        generator: torch.Generator | list[torch.Generator],
        output_type: str,
        callback_on_step_end: Callable | None,
        callback_on_step_end_tensor_inputs: list[str],
    ):
        self.pipe = pipe
        self.prompt_embeds = prompt_embeds
        self.negative_prompt_embeds = negative_prompt_embeds
        self.latent_shape = latent_shape  # [B, C, frames_per_chunk, h, w] of one chunk
        self.num_chunks = num_chunks
        self.guidance_scale = guidance_scale
        self.context_noise = context_noise
        self.sigmas = sigmas
        self.generator = generator
        self.output_type = output_type
        self.callback_on_step_end = callback_on_step_end
        self.callback_on_step_end_tensor_inputs = callback_on_step_end_tensor_inputs
        self.decoder = StreamingWanDecoder(pipe.vae) if output_type != "latent" else None
        self.chunk_index = 0
        self._step = 0
        self.cache = pipe._install_cache(
            kv_cache, window_frames=window_frames, sink_frames=sink_frames,
            keep_recent_chunks=keep_recent_chunks, keys_before_rope=keys_before_rope, commit="final-pass",
            expected_frames=None if num_chunks is None else num_chunks * latent_shape[2],
        )
        self.closed = False
        # diffusers' bar needs a total or an iterable: an endless stream counts against an endless iterable.
        forwards = len(sigmas) + 1
        self._progress = (pipe.progress_bar(iterable=itertools.count()) if num_chunks is None
                          else pipe.progress_bar(total=num_chunks * forwards))

    @property
    def do_classifier_free_guidance(self) -> bool:
        return self.guidance_scale > 1.0

    @property
    def start_frame(self) -> int:
        """Latent frame where the next chunk starts."""
        return self.chunk_index * self.latent_shape[2]

    @property
    def done(self) -> bool:
        return self.closed or (self.num_chunks is not None and self.chunk_index >= self.num_chunks)

    def __iter__(self) -> Iterator[Any]:
        while not self.done:
            yield self.next_chunk()
        if not self.closed and self.num_chunks is not None:
            self._progress.close()

    def __enter__(self) -> "QVGStreamState":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self) -> None:
        """Start a new video: empty cache, fresh decoder, chunk 0."""
        self._check_open()
        self.cache.reset()
        if self.decoder is not None:
            self.decoder.reset()
        self.chunk_index = 0
        self._step = 0

    def close(self) -> None:
        """Remove the cache from the transformer (stock processors again); idempotent."""
        if not self.closed:
            self.closed = True
            self._progress.close()
            self.pipe._uninstall_cache(self.cache)
            self.pipe._release_stream(self)

    @torch.no_grad()
    def next_chunk(self) -> Any:
        """Generate, commit and decode the next chunk; returns its frames in ``output_type``."""
        self._check_open()
        if self.done:
            raise RuntimeError(f"the stream already produced its {self.num_chunks} chunks; reset() to start again")
        pipe, scheduler = self.pipe, self.pipe.scheduler
        latents = randn_tensor(self.latent_shape, generator=self.generator, device=pipe._execution_device,
                               dtype=torch.float32)
        scheduler.set_timesteps(sigmas=self.sigmas, device=pipe._execution_device)
        for t in scheduler.timesteps:
            flow = self._forward(latents, t)
            latents = scheduler.step(flow, t, latents, generator=self.generator, return_dict=False)[0]
            latents = self._callback(t, latents)
            self._progress.update()
        # The last step re-noises to sigma 0: ``latents`` is the chunk's x0. Store its clean K/V.
        self._forward(latents, torch.tensor(self.context_noise, device=latents.device), final=True)
        self._progress.update()
        self.chunk_index += 1
        if self.decoder is None:
            return latents
        video = self.decoder.decode(latents)
        return pipe.video_processor.postprocess_video(video, output_type=self.output_type)

    def _forward(self, latents: torch.Tensor, t: torch.Tensor, final: bool = False) -> torch.Tensor:
        """The flow prediction for the current chunk (CFG as one batch over one cache), in float32; ``final``:
        the clean-context pass, which stores the chunk's K/V."""
        transformer = self.pipe.transformer
        model_input = latents.to(transformer.dtype)
        text = self.prompt_embeds
        if self.do_classifier_free_guidance:
            model_input = torch.cat([model_input, model_input])
            text = torch.cat([self.negative_prompt_embeds, self.prompt_embeds])
        timestep = t.to(torch.float32).expand(model_input.shape[0])
        with self.cache.chunk(start_frame=self.start_frame, final=final, hidden_states=model_input):
            flow = transformer(hidden_states=model_input, timestep=timestep, encoder_hidden_states=text,
                               return_dict=False)[0].float()
        if self.do_classifier_free_guidance:
            uncond, cond = flow.chunk(2)
            flow = uncond + self.guidance_scale * (cond - uncond)
        return flow

    def _callback(self, t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        if self.callback_on_step_end is None:
            self._step += 1
            return latents
        tensors = {"latents": latents, "prompt_embeds": self.prompt_embeds,
                   "negative_prompt_embeds": self.negative_prompt_embeds}
        kwargs = {k: tensors[k] for k in self.callback_on_step_end_tensor_inputs}
        outputs = self.callback_on_step_end(self.pipe, self._step, t, kwargs) or {}
        self._step += 1
        self.prompt_embeds = outputs.pop("prompt_embeds", self.prompt_embeds)
        self.negative_prompt_embeds = outputs.pop("negative_prompt_embeds", self.negative_prompt_embeds)
        return outputs.pop("latents", latents)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this stream is closed (its cache was removed); start a new one with pipe.stream(...)")
