"""The one interface every KV storage format implements, so caches and benchmarks compare them in one run.

A codec works on *storage*: preallocated tensors that hold many token segments of a
``[batch, tokens, heads, head_dim]`` tensor. A segment is a token range packed by one call; formats with
per-segment parameters (QVG's centroids) keep them in a numbered *slot*. ``quantize``/``dequantize``
are the single-tensor case (one segment, one slot) of the same two verbs the cache uses:
``quantize_into`` (pack one finished chunk in place) and ``dequantize_into`` (unpack many segments into a
caller's workspace in one call).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

Role = Literal["key", "value"]
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Columns of a segment table, an int32 tensor [num_segments, 4] on the storage's device.
SRC_START, LENGTH, DST_START, SLOT = range(4)


def segment_table(rows: list[tuple[int, int, int, int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Build a segment table from ``(src_start, length, dst_start, slot)`` rows."""
    table = torch.tensor(rows, dtype=torch.int32, device=device).reshape(-1, 4)
    if (table[:, LENGTH] < 1).any() or (table[:, [SRC_START, DST_START, SLOT]] < 0).any():
        raise ValueError(f"segment table rows must have length >= 1 and non-negative starts and slots, got {rows}")
    return table


@dataclass
class Packed(ABC):
    """Storage of one codec: every tensor it holds counts in ``nbytes``.

    ``config`` is the codec that wrote it; ``shape`` is the logical ``(batch, capacity_tokens, heads, head_dim)``; ``dtype`` what it decodes to.
    """

    config: "CodecConfig"
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    num_slots: int

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this storage holds, by name."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors().values())).device

    def bits_per_element(self) -> float:
        return 8.0 * self.nbytes / math.prod(self.shape)


class CodecConfig(ABC):
    """A storage format's settings; the config is also the codec (one object, one registry line)."""

    name: ClassVar[str]

    def validate_input(self, x: torch.Tensor, what: str = "x") -> None:
        """Raise a clear error for inputs no codec can store; subclasses add their own rules."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(
                f"{what} must have shape [batch, tokens, heads, head_dim] (rank 4), got rank {x.dim()} "
                f"shape {tuple(x.shape)}; reshape with x.unflatten(-1, (heads, head_dim)) first"
            )
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{what} must be a floating tensor (float16/bfloat16/float32/float64), got {x.dtype}")
        if x.numel() == 0:
            raise ValueError(f"{what} is empty (shape {tuple(x.shape)}); there is nothing to quantize")
        if not torch.isfinite(x).all():
            raise ValueError(f"{what} contains NaN or Inf values; fix the model output before caching it")

    @abstractmethod
    def allocate(
        self,
        *,
        batch: int,
        capacity_tokens: int,
        heads: int,
        head_dim: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        role: Role = "value",
    ) -> Packed:
        """Preallocate storage for ``capacity_tokens`` tokens in ``num_slots`` segments.

        ``role`` matters only to formats whose layout differs for keys and values (KIVI).
        """

    @abstractmethod
    def quantize_into(
        self,
        storage: Packed,
        x: torch.Tensor,
        *,
        token_start: int,
        slot: int,
        role: Role = "value",
        warm_start: Packed | None = None,
        warm_slot: int = 0,
    ) -> None:
        """Pack ``x`` [B, N, H, D] into ``storage`` tokens ``[token_start, token_start + N)`` and ``slot``.

        ``warm_start``/``warm_slot`` name a slot of earlier storage whose parameters (QVG's centroids)
        seed this one; formats without such parameters ignore them.
        """

    @abstractmethod
    def dequantize_into(
        self,
        storage: Packed,
        segments: torch.Tensor,
        out: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Decode every row of ``segments`` (see :func:`segment_table`) into ``out`` [B, W, H, D].

        With ``rotary=(cos, sin)`` (each [1, W, 1, D], aligned with ``out``'s tokens) the decoded tokens are
        rotated by Wan's RoPE (:func:`diffusers_qvg.rotary.apply_wan_rotary`) before the cast to ``out``'s
        dtype: keys stored before RoPE come out as the attention expects them.
        """

    def check_storage_fits(self, storage: Packed, x: torch.Tensor, token_start: int, slot: int) -> None:
        """Validate a ``quantize_into`` call before anything is written."""
        self.validate_input(x)
        if storage.config != self:
            raise ValueError(
                f"this storage was allocated by {storage.config!r}, not by {self!r}; "
                "quantize with the config that allocated it"
            )
        if x.dtype != storage.dtype:
            raise ValueError(f"x has dtype {x.dtype} but the storage holds {storage.dtype}; cast x first")
        B, T, H, D = storage.shape
        b, n, h, d = x.shape
        if (b, h, d) != (B, H, D):
            raise ValueError(
                f"x has batch/heads/head_dim {(b, h, d)} but the storage was allocated for {(B, H, D)}; "
                "allocate storage with the shape of the tensors you cache"
            )
        if not 0 <= token_start or token_start + n > T:
            raise ValueError(f"tokens [{token_start}, {token_start + n}) do not fit the storage capacity {T}")
        if not 0 <= slot < storage.num_slots:
            raise ValueError(f"slot {slot} is outside the storage's {storage.num_slots} slots")
        if x.device != storage.device:
            raise ValueError(f"x is on {x.device} but the storage is on {storage.device}; move x first")

    def check_segments(
        self,
        storage: Packed,
        segments: torch.Tensor,
        out: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Validate a ``dequantize_into`` call (shapes and ranges) before anything is written."""
        if segments.dtype != torch.int32 or segments.dim() != 2 or segments.shape[1] != 4:
            raise ValueError(f"segments must be an int32 tensor [num_segments, 4], got {segments.dtype} {tuple(segments.shape)}")
        B, T, H, D = storage.shape
        if out.dim() != 4 or (out.shape[0], out.shape[2], out.shape[3]) != (B, H, D):
            raise ValueError(f"out must have shape [{B}, window, {H}, {D}], got {tuple(out.shape)}")
        if out.dtype != storage.dtype:
            raise ValueError(f"out has dtype {out.dtype} but the storage decodes to {storage.dtype}")
        if rotary is not None:
            W = out.shape[1]
            for t in rotary:
                if t.dim() != 4 or t.shape[1] != W or t.shape[-1] != D:
                    raise ValueError(f"rotary cos/sin must have shape [1, {W}, 1, {D}] to match out, got {tuple(t.shape)}")
        if len(segments):
            rows = segments.cpu().long()
            if (rows[:, LENGTH] < 1).any() or (rows[:, SRC_START] < 0).any() or (rows[:, DST_START] < 0).any():
                raise ValueError("segment rows need length >= 1 and non-negative starts")
            if (rows[:, SRC_START] + rows[:, LENGTH] > T).any():
                raise ValueError(f"a segment reads past the storage capacity {T}")
            if (rows[:, DST_START] + rows[:, LENGTH] > out.shape[1]).any():
                raise ValueError(f"a segment writes past the workspace length {out.shape[1]}")
            if ((rows[:, SLOT] < 0) | (rows[:, SLOT] >= storage.num_slots)).any():
                raise ValueError(f"a segment names a slot outside [0, {storage.num_slots})")

    def quantize(self, x: torch.Tensor, *, role: Role = "value", warm_start: Packed | None = None) -> Packed:
        """Pack one tensor as a single segment."""
        self.validate_input(x)
        B, N, H, D = x.shape
        storage = self.allocate(
            batch=B, capacity_tokens=N, heads=H, head_dim=D, num_slots=1, dtype=x.dtype, device=x.device, role=role
        )
        self.quantize_into(storage, x, token_start=0, slot=0, role=role, warm_start=warm_start)
        return storage

    def dequantize(self, packed: Packed) -> torch.Tensor:
        """Decode a single-segment ``quantize`` result back to ``[B, N, H, D]`` in its input dtype."""
        B, N, H, D = packed.shape
        out = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        self.dequantize_into(packed, segment_table([(0, N, 0, 0)], device=packed.device), out)
        return out
