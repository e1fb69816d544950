"""Cache policy, validated once: which codec stores finished chunks, and which chunks stay visible."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..codecs import BF16Config, CodecConfig, resolve_codec


@dataclass(frozen=True)
class CacheConfig:
    """Where each chunk of a layer's K/V lives, oldest to newest: sink, packed history, recent, current.

    ``commit`` says when a chunk's K/V are stored for later chunks. ``"on-advance"``: every forward writes
    the chunk into a BF16 slot of its own, and the chunk is final when the next one starts. ``"final-pass"``:
    denoising forwards attend to their fresh K/V but store nothing; the forward inside
    ``cache.chunk(start_frame=f, final=True)`` (the clean-context pass) stores them straight where a finished
    chunk goes (sink, a recent slot, or the packed pool), so no current-chunk slot exists.

    Fields:
        storage: codec of the packed history (a preset name such as ``"qvg-int2"`` or a codec config).
        window_frames: latent frames visible to a chunk, counting the sink and the chunk itself; ``None``
            keeps the whole history. Whole chunks are evicted, so the window may hold fewer frames.
        sink_frames: the stream's first frames, never evicted; must end on a chunk boundary.
        sink_storage: codec of the sink chunks (BF16 by default: every chunk reads them).
        keep_recent_chunks: finished chunks kept unquantized before they are packed.
        keys_before_rope: store K before RoPE (clusters far better) and rotate on read; ``False`` stores
            the rotated keys.
        warm_start: seed a chunk's k-means with the previously packed chunk's parameters (QVG only).
        chunk_frames: the largest chunk in frames (the size of a slot); ``None`` takes the first chunk's.
        commit: ``"on-advance"`` or ``"final-pass"`` (above).
        expected_frames: latent frames the stream is expected to span (a pipeline knows them): the packed
            pool is preallocated for exactly those chunks rather than in blocks of 8 (it still grows beyond).
        rope_frames: frame positions RoPE may use; ``None``: the transformer's ``rope_max_seq_len``. A stream
            running past them re-bases its window (:func:`~diffusers_qvg.cache.plan.window_positions`).
        encode_layers: layers whose writes of a finished chunk go in one encoder call (QVG's batched encoder
            launches the same 14 kernels for any number of layers, with more programs each). The clean-context
            pass holds this many layers' chunk K/V until the group's last layer has attended.
    """

    storage: CodecConfig | str = "qvg-int2"
    window_frames: int | None = None
    sink_frames: int = 0
    sink_storage: CodecConfig | str = "bf16"
    keep_recent_chunks: int = 1
    keys_before_rope: bool = True
    warm_start: bool = False
    chunk_frames: int | None = None
    commit: Literal["on-advance", "final-pass"] = "on-advance"
    expected_frames: int | None = None
    rope_frames: int | None = None
    encode_layers: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "storage", resolve_codec(self.storage))
        object.__setattr__(self, "sink_storage", resolve_codec(self.sink_storage))
        for name in ("sink_frames", "keep_recent_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} is invalid: use a non-negative integer")
        if self.commit not in ("on-advance", "final-pass"):
            raise ValueError(f"commit={self.commit!r} is invalid: use 'on-advance' or 'final-pass'")
        if not isinstance(self.encode_layers, int) or isinstance(self.encode_layers, bool) or self.encode_layers < 1:
            raise ValueError(f"encode_layers={self.encode_layers!r} is invalid: use a positive number of layers")
        for name in ("window_frames", "chunk_frames", "expected_frames", "rope_frames"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} is invalid: use a positive number of latent frames or None")
        if self.window_frames is not None and self.window_frames <= self.sink_frames:
            raise ValueError(
                f"window_frames={self.window_frames} leaves no room beside sink_frames={self.sink_frames}; "
                "the window counts the sink, so make it larger than the sink plus one chunk"
            )

    @property
    def dense(self) -> CodecConfig:
        """The codec of the recent and current chunks (unquantized, in the model's dtype)."""
        return BF16Config()

    @property
    def in_place(self) -> bool:
        """Nothing quantized and keys stored rotated: each layer attends to its storage in place
        (:mod:`~diffusers_qvg.cache.window`), as Self-Forcing's own cache does; nothing is decoded."""
        dense = isinstance(self.storage, BF16Config) and isinstance(self.sink_storage, BF16Config)
        return dense and not self.keys_before_rope

    @property
    def current_slots(self) -> int:
        """Unquantized slots for the chunk being denoised: 1 when every forward stores it, else 0."""
        return int(self.commit == "on-advance")
