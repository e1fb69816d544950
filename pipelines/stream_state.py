"""One autoregressive video in progress: its KV cache, its noise generator, its decoder state, its position.

The chunk loop of Self-Forcing (``pipeline/causal_inference.py``), written for diffusers: per chunk of
``frames_per_chunk`` latent frames, fresh noise is denoised by a few forwards (x0 prediction, then re-noising
to the next sigma: ``FlowMatchLCMScheduler.step``), then one more forward at ``context_noise`` on the clean x0
writes the chunk's final K/V into the cache, and the chunk is decoded. The cache runs with
``commit="final-pass"``: the denoising forwards (``cache.chunk(start_frame=f)``) attend to the cache and to
their own K/V but store nothing; the clean-context pass (``cache.chunk(start_frame=f, final=True)``) stores the
chunk straight into its final place, so no BF16 slot is held for the chunk being denoised.

Interactive streams: :meth:`QVGStreamState.set_prompt` (or a ``prompt_switches`` schedule) switches the text at a
chunk boundary, and first stores the visible chunks after the sink again under the new text by re-running
their clean-context passes (``QVGCache.recache``); the stream keeps those chunks' clean latents for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from .prompt_switch import PromptSwitch, TextSettings, check_switch_frame, encode_switch
from .streaming_decoder import StreamingWanDecoder

if TYPE_CHECKING:
    from .pipeline_qvg_causal_wan import QVGCausalWanPipeline


class QVGStreamState:
    """Owns the cache of one video; iterate it for each chunk's frames (see ``QVGCausalWanPipeline.stream``).

    Keep it to continue the video later (``next_chunk()`` or iterate again), switch its prompt between chunks
    (:meth:`set_prompt`), ``reset()`` it to start a new video with the same prompt and settings (the cache and
    the decoder are emptied, the first prompt and the ``prompt_switches`` schedule restored, the generator not
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
        text_settings: TextSettings,
        prompt_switches: Iterable[PromptSwitch] = (),
    ):
        self.pipe = pipe
        self.prompt_embeds = prompt_embeds
        self.negative_prompt_embeds = negative_prompt_embeds
        self.first_text = (prompt_embeds, negative_prompt_embeds)
        self.text_settings = text_settings
        self.schedule = {switch.frame: switch for switch in prompt_switches}
        self.switches = dict(self.schedule)  # frame -> the switch the chunk starting there applies first
        self.clean_latents: dict[int, torch.Tensor] = {}  # start frame -> x0 of each chunk a re-cache stores again
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
    def end_frame(self) -> int | None:
        """Latent frame where the video ends (``None``: an endless stream)."""
        return None if self.num_chunks is None else self.num_chunks * self.latent_shape[2]

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
        self.prompt_embeds, self.negative_prompt_embeds = self.first_text
        self.switches = dict(self.schedule)
        self.clean_latents = {}

    @torch.no_grad()
    def set_prompt(
        self,
        prompt: str | list[str] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt: str | list[str] | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        recache: bool = True,
        *,
        at_frame: int | None = None,
    ) -> None:
        """Switch to a new prompt from the next chunk on (or from latent frame ``at_frame``, a later chunk
        boundary); a later call for the same frame replaces this one.

        The chunk's cross-attention takes the new text. ``recache=True`` first stores the visible chunks
        after the sink again, recomputed from their clean latents at ``context_noise`` under the new text, so
        the new prompt takes hold without a cut (LongLive's KV re-cache; the sink keeps its K/V); ``False``
        keeps their K/V. ``negative_prompt(_embeds)`` matter with guidance only; without them the stream's
        negative text stays. Embeddings must have the stream's batch and text_dim. Bad arguments raise here,
        before anything changes.
        """
        self._check_open()
        frame = self.start_frame if at_frame is None else at_frame
        check_switch_frame(frame, self.latent_shape[2], self.start_frame, self.end_frame)
        self.switches[frame] = encode_switch(
            self.pipe, frame, prompt=prompt, prompt_embeds=prompt_embeds, negative_prompt=negative_prompt,
            negative_prompt_embeds=negative_prompt_embeds, recache=recache, like=self.prompt_embeds,
            settings=self.text_settings,
        )

    def close(self) -> None:
        """Remove the cache from the transformer (stock processors again); idempotent."""
        if not self.closed:
            self.closed = True
            self.clean_latents = {}
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
        switch = self.switches.get(self.start_frame)
        if switch is not None:
            self._switch_prompt(switch)
        latents = randn_tensor(self.latent_shape, generator=self.generator, device=pipe._execution_device,
                               dtype=torch.float32)
        scheduler.set_timesteps(sigmas=self.sigmas, device=pipe._execution_device)
        for t in scheduler.timesteps:
            flow = self._forward(latents, t, self.start_frame)
            latents = scheduler.step(flow, t, latents, generator=self.generator, return_dict=False)[0]
            latents = self._callback(t, latents)
            self._progress.update()
        # The last step re-noises to sigma 0: ``latents`` is the chunk's x0. Store its clean K/V.
        self._forward(latents, self._context_timestep(), self.start_frame, final=True)
        self._progress.update()
        self._keep_clean(latents)
        self.chunk_index += 1
        if self.decoder is None:
            return latents
        video = self.decoder.decode(latents)
        return pipe.video_processor.postprocess_video(video, output_type=self.output_type)

    def _switch_prompt(self, switch: PromptSwitch) -> None:
        """Apply the switch due at this chunk: with ``recache``, store the visible chunks after the sink again
        under the new text, oldest first, each from its clean latents by a clean-context pass; then use it."""
        negative = self.negative_prompt_embeds if switch.negative_prompt_embeds is None else switch.negative_prompt_embeds
        if switch.recache:
            with self.cache.recache() as chunks:
                for start, _ in chunks:
                    self._forward(self.clean_latents[start], self._context_timestep(), start, final=True,
                                  text=(switch.prompt_embeds, negative))
        self.prompt_embeds, self.negative_prompt_embeds = switch.prompt_embeds, negative
        del self.switches[switch.frame]

    def _keep_clean(self, latents: torch.Tensor) -> None:
        """Hold the x0 of the chunks a re-cache would store again (the visible ones after the sink), as the
        clean-context pass took it; free the others."""
        visible = {start for start, _ in self.cache.recache_chunks()}
        if self.start_frame in visible:
            self.clean_latents[self.start_frame] = latents.to(self.pipe.transformer.dtype, copy=True)
        self.clean_latents = {start: x for start, x in self.clean_latents.items() if start in visible}

    def _context_timestep(self) -> torch.Tensor:
        return torch.tensor(self.context_noise, device=self.pipe._execution_device)

    def _forward(
        self,
        latents: torch.Tensor,
        t: torch.Tensor,
        start_frame: int,
        final: bool = False,
        text: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """The flow prediction for the chunk at ``start_frame`` (CFG as one batch over one cache), in float32;
        ``final``: the clean-context pass, which stores the chunk's K/V; ``text``: (prompt, negative)
        embeddings other than the stream's."""
        transformer = self.pipe.transformer
        model_input = latents.to(transformer.dtype)
        prompt_embeds, negative_prompt_embeds = (self.prompt_embeds, self.negative_prompt_embeds) if text is None else text
        text_states = prompt_embeds
        if self.do_classifier_free_guidance:
            model_input = torch.cat([model_input, model_input])
            text_states = torch.cat([negative_prompt_embeds, prompt_embeds])
        timestep = t.to(torch.float32).expand(model_input.shape[0])
        with self.cache.chunk(start_frame=start_frame, final=final, hidden_states=model_input):
            flow = transformer(hidden_states=model_input, timestep=timestep, encoder_hidden_states=text_states,
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
