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
import operator
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Iterable, Literal, NamedTuple, Sequence

import torch

from ..rotary import Rotary, rotary_tensors
from .status import WriteStatus

Role = Literal["key", "value"]
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Columns of a segment table row.
SRC_START, LENGTH, DST_START, SLOT = range(4)
Row = tuple[int, int, int, int]
INT32_MAX = 2**31 - 1
# The most destination tokens one tile of SegmentTable.tiles spans (a kernel program's share of a table).
TILE_TOKENS = 256


def checked_rows(rows: Iterable[Sequence[int]]) -> tuple[Row, ...]:
    """``rows`` as a tuple of ``(src_start, length, dst_start, slot)`` ints, or a clear error."""
    checked = []
    for row in rows:
        row = tuple(operator.index(v) for v in row)
        if len(row) != 4:
            raise ValueError(f"segment table rows are (src_start, length, dst_start, slot), got {row}")
        checked.append(row)
    for src, n, dst, slot in checked:
        if n < 1 or min(src, dst, slot) < 0:
            raise ValueError(f"segment table rows must have length >= 1 and non-negative starts and slots, got {checked}")
        if max(src + n, dst + n, slot) > INT32_MAX:
            raise ValueError(f"segment table rows must fit int32 (the kernels read them as int32), got {checked}")
    return tuple(checked)


def disjoint_pieces(rows: Sequence[Row]) -> list[Row]:
    """``rows`` as disjoint destination ranges, each token taken from the last row that writes it (the order
    in which decoders copy rows: later rows win), sorted by destination. Same rows format; O(rows^2)."""
    cuts = sorted({r[DST_START] for r in rows} | {r[DST_START] + r[LENGTH] for r in rows})
    pieces: list[Row] = []
    for lo, hi in zip(cuts, cuts[1:]):
        last = next((r for r in reversed(rows) if r[DST_START] <= lo and hi <= r[DST_START] + r[LENGTH]), None)
        if last is None:
            continue  # a gap: no row writes these tokens
        src = last[SRC_START] + lo - last[DST_START]
        prev = pieces[-1] if pieces else None
        if prev and prev[DST_START] + prev[LENGTH] == lo and prev[SLOT] == last[SLOT] and prev[SRC_START] + prev[LENGTH] == src:
            pieces[-1] = (prev[SRC_START], prev[LENGTH] + hi - lo, prev[DST_START], prev[SLOT])
        else:
            pieces.append((src, hi - lo, lo, last[SLOT]))
    return pieces


def tile_rows(rows: Sequence[Row], tile_tokens: int = TILE_TOKENS) -> list[tuple[int, int, int, int]]:
    """The table's destination tokens cut into tiles ``(src_start, dst_start, tokens, slot)`` of at most
    ``tile_tokens`` tokens, disjoint and each inside one row's range (see :func:`disjoint_pieces`)."""
    tiles = []
    for src, n, dst, slot in disjoint_pieces(rows):
        for start in range(0, n, tile_tokens):
            tiles.append((src + start, dst + start, min(tile_tokens, n - start), slot))
    return tiles


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``; on CUDA from pinned memory without blocking (no sync)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class HeadSlice(NamedTuple):
    """Which of a model's heads a tensor holds: heads ``[start, start + count)`` of ``total`` (one rank's share
    of a head-sharded cache under Ulysses context parallelism). Formats that draw random numbers per head
    (QVG's ``"random"`` and ``"kmeans++"`` inits) draw for every head of the model and keep this slice, so a
    head packs to the same bytes however the heads are split across ranks."""

    start: int
    count: int
    total: int

    def check(self, heads: int, what: str = "x") -> None:
        if not (0 <= self.start and self.count == heads and self.start + self.count <= self.total):
            raise ValueError(
                f"{what} holds {heads} heads but heads={self!r} says heads [{self.start}, {self.start + self.count}) "
                f"of {self.total}; pass the slice of the model's heads that {what} holds"
            )


@dataclass(frozen=True, eq=False)  # identity equality: tensors have no single truth value
class SegmentTable:
    """Which token ranges of a storage land where in a workspace, validated once on the host.

    ``rows`` are the host copy every check and every PyTorch decoder reads; ``tensor`` is the same rows as
    an int32 [num_segments, 4] tensor on the storage's device. ``tiles`` (int32 [num_tiles, 4] on the same
    device, rows ``(src_start, dst_start, tokens, slot)``) is the work list kernels launch over: the written
    tokens cut into disjoint runs of at most ``TILE_TOKENS``, later rows already winning where rows overlap,
    so a program reads its tile once (no search) and no program covers an unwritten token. Both are built
    here, once per table, so decoding a table never reads device memory on the host (no device sync):
    build tables with :func:`segment_table` once per layout and reuse them. ``tensor`` must hold ``rows``.
    """

    rows: tuple[Row, ...]
    tensor: torch.Tensor
    src_end: int = field(init=False)  # one past the last storage token read
    dst_end: int = field(init=False)  # one past the last workspace token written
    slot_end: int = field(init=False)  # one past the largest slot named
    tiles: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        rows = checked_rows(self.rows)
        if self.tensor.dtype != torch.int32 or tuple(self.tensor.shape) != (len(rows), 4):
            raise ValueError(
                f"a segment table's tensor must be int32 [{len(rows)}, 4] like its rows, got "
                f"{self.tensor.dtype} {tuple(self.tensor.shape)}; build tables with segment_table(rows, device)"
            )
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "src_end", max((r[SRC_START] + r[LENGTH] for r in rows), default=0))
        object.__setattr__(self, "dst_end", max((r[DST_START] + r[LENGTH] for r in rows), default=0))
        object.__setattr__(self, "slot_end", max((r[SLOT] + 1 for r in rows), default=0))
        tiles = torch.tensor(tile_rows(rows), dtype=torch.int32).reshape(-1, 4)
        object.__setattr__(self, "tiles", _to_device(tiles, self.tensor.device))

    def __len__(self) -> int:
        return len(self.rows)

    def to(self, device: torch.device | str) -> "SegmentTable":
        return segment_table(self.rows, device)


def segment_table(rows: Iterable[Sequence[int]], device: torch.device | str = "cpu") -> SegmentTable:
    """Build a segment table from ``(src_start, length, dst_start, slot)`` rows, its tensor on ``device``.

    On CUDA the rows travel from pinned memory without blocking: building a table does not synchronise either.
    """
    rows = checked_rows(rows)
    host = torch.tensor(rows, dtype=torch.int32).reshape(-1, 4)
    return SegmentTable(rows, _to_device(host, torch.device(device)))


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
    # Largest input magnitude the format stores (None: any finite value).
    max_abs_input: ClassVar[float | None] = None

    def check_layout(self, x: torch.Tensor, what: str = "x") -> None:
        """Raise a clear error for inputs of a shape or dtype this codec cannot store (no device reads);
        subclasses add their own rules. :meth:`check_values` checks the values."""
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

    def check_values(
        self, x: torch.Tensor, what: str = "x", must_hold: Sequence[tuple[torch.Tensor, str]] = ()
    ) -> None:
        """Raise if ``x`` holds NaN/Inf or magnitudes beyond ``max_abs_input``, or if a ``must_hold`` condition
        (a boolean device scalar, with the message to raise) is false.

        One reduction (``aminmax`` propagates NaN) and one host sync for all of them: ``quantize_into`` runs
        for every layer's K and V at every chunk, so it reads the device once.
        """
        lo, hi = torch.aminmax(x)
        stats = torch.stack([lo.double(), hi.double(), *(ok.double() for ok, _ in must_hold)]).tolist()
        lo, hi, *held = stats
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError(f"{what} contains NaN or Inf values; fix the model output before caching it")
        amax, limit = max(-lo, hi), self.max_abs_input
        if limit is not None and amax > limit:
            raise ValueError(
                f"{what} has values up to {amax:.3g}; {self.name} stores magnitudes up to 2^{math.log2(limit):g} "
                f"(~{limit:.2g}), beyond which float32 distances and scales overflow; rescale the tensor"
            )
        for ok, (_, message) in zip(held, must_hold):
            if not ok:
                raise ValueError(message)

    def check_write(
        self,
        x: torch.Tensor,
        status: WriteStatus | None,
        what: str = "x",
        must_hold: Sequence[tuple[torch.Tensor, str]] = (),
    ) -> bool:
        """The values check of a ``quantize_into`` call: on the host (one sync, raising at once) without a
        ``status``; else folded into ``status`` on the device, no host read.

        Returns True where the caller may write unconditionally (no status: a failure has raised), False
        where it must predicate its stores on the status: ``status.ok()`` in kernels, ``status.gated_copy_``
        in PyTorch, or ``status.ok_on_host()`` in reference paths (free on the CPU, a sync elsewhere).
        """
        if status is None:
            self.check_values(x, what, must_hold)
            return True
        status.check(x, what, self.max_abs_input, must_hold)
        return False

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
        status: WriteStatus | None = None,
        what: str = "x",
        heads: HeadSlice | None = None,
    ) -> None:
        """Pack ``x`` [B, N, H, D] into ``storage`` tokens ``[token_start, token_start + N)`` and ``slot``.

        ``warm_start``/``warm_slot`` name a slot of earlier storage whose parameters (QVG's centroids)
        seed this one; formats without such parameters ignore them. ``heads``: which of the model's heads
        ``x`` holds (``None``: all of them); formats without per-head random draws ignore it.
        Implementations validate with
        :meth:`check_storage_fits` and their own layout rules (raising at once), then the values with
        :meth:`check_write`: without ``status`` on the host (the one sync), with it on the device, every
        store predicated on ``status.ok()`` so that a failed write changes nothing (``what`` names the
        write in the error the status raises later).
        """

    def quantize_batch_into(
        self,
        items: Sequence[tuple[Packed, torch.Tensor, int, int]],
        *,
        roles: Sequence[Role] | None = None,
        warm_starts: Sequence[tuple[Packed, int] | None] | None = None,
        status: WriteStatus | None = None,
        whats: Sequence[str] | None = None,
        heads: HeadSlice | None = None,
    ) -> None:
        """Pack several segments, ``items[i] = (storage, x, token_start, slot)``, as :meth:`quantize_into`
        would one after another (``roles``, ``warm_starts`` as ``(storage, slot)`` and ``whats`` per item;
        ``heads`` for all of them).

        Codecs with batched kernels override this to pack every item in one launch sequence (QVG: a layer's K
        and V, or several layers). The layout of every item is validated before anything is written; the
        values as by :meth:`quantize_into`: with ``status`` each item's check is folded into it on the device
        and an item stores only if no earlier write failed; without, a bad item raises after the items before
        it were written.
        """
        roles, warm_starts, whats = self.batch_arguments(items, roles, warm_starts, whats)
        for storage, x, token_start, slot in items:
            self.check_storage_fits(storage, x, token_start, slot)
        for (storage, x, token_start, slot), role, warm, what in zip(items, roles, warm_starts, whats):
            self.quantize_into(
                storage, x, token_start=token_start, slot=slot, role=role, warm_start=None if warm is None else warm[0],
                warm_slot=0 if warm is None else warm[1], status=status, what=what, heads=heads,
            )  # fmt: skip

    @staticmethod
    def batch_arguments(
        items: Sequence[tuple[Packed, torch.Tensor, int, int]],
        roles: Sequence[Role] | None,
        warm_starts: Sequence[tuple[Packed, int] | None] | None,
        whats: Sequence[str] | None,
    ) -> tuple[list[Role], list[tuple[Packed, int] | None], list[str]]:
        """:meth:`quantize_batch_into`'s per-item arguments with their defaults, or a clear error."""
        n = len(items)
        if n == 0:
            raise ValueError("quantize_batch_into got no items; pass (storage, x, token_start, slot) tuples")
        for i, item in enumerate(items):
            if not isinstance(item, tuple) or len(item) != 4:
                raise TypeError(f"items[{i}] must be a (storage, x, token_start, slot) tuple, got {type(item).__name__}")
        lists = dict(roles=roles, warm_starts=warm_starts, whats=whats)
        for name, values in lists.items():
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} items; give one per item (or None)")
        return (
            list(roles) if roles is not None else ["value"] * n,
            list(warm_starts) if warm_starts is not None else [None] * n,
            list(whats) if whats is not None else [f"item {i}" for i in range(n)],
        )

    @abstractmethod
    def dequantize_into(
        self,
        storage: Packed,
        segments: SegmentTable,
        out: torch.Tensor,
        rotary: Rotary | None = None,
    ) -> None:
        """Decode every row of ``segments`` (see :func:`segment_table`) into ``out`` [B, W, H, D].

        With ``rotary`` (``(cos, sin)``, each [1, W, 1, D], or a :class:`~diffusers_qvg.rotary.RotaryPairs`,
        aligned with ``out``'s tokens) the decoded tokens are rotated by Wan's RoPE
        (:func:`diffusers_qvg.rotary.rotate`) before the cast to ``out``'s dtype: keys stored before RoPE come
        out as the attention expects them. Validation reads only the table's host rows, so a call never
        synchronises the device.
        """

    def dequantize_pair_into(
        self,
        key_storage: Packed,
        value_storage: Packed,
        segments: SegmentTable,
        key_out: torch.Tensor,
        value_out: torch.Tensor,
        rotary: Rotary | None = None,
    ) -> None:
        """Decode one table of a layer's keys and values: :meth:`dequantize_into` for each, ``rotary`` on the keys
        only. Both calls are validated before either writes. Formats that decode both in one kernel override it."""
        self.check_segments(key_storage, segments, key_out, rotary)
        self.check_segments(value_storage, segments, value_out)
        self.dequantize_into(key_storage, segments, key_out, rotary)
        self.dequantize_into(value_storage, segments, value_out)

    def check_storage_fits(self, storage: Packed, x: torch.Tensor, token_start: int, slot: int) -> None:
        """Validate a ``quantize_into`` call's layout before anything is written (no device reads; the
        values are :meth:`check_values`'s)."""
        self.check_layout(x)
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
        segments: SegmentTable,
        out: torch.Tensor,
        rotary: Rotary | None = None,
    ) -> None:
        """Validate a ``dequantize_into`` call before anything is written, from the table's host rows only."""
        if not isinstance(segments, SegmentTable):
            raise TypeError(
                f"segments must be a SegmentTable, got {type(segments).__name__}; build it once with "
                "segment_table(rows, device) and reuse it"
            )
        B, T, H, D = storage.shape
        if out.dim() != 4 or (out.shape[0], out.shape[2], out.shape[3]) != (B, H, D):
            raise ValueError(f"out must have shape [{B}, window, {H}, {D}], got {tuple(out.shape)}")
        if out.dtype != storage.dtype:
            raise ValueError(f"out has dtype {out.dtype} but the storage decodes to {storage.dtype}")
        if rotary is not None:
            W = out.shape[1]
            for t in rotary_tensors(rotary):
                if t.dim() != 4 or t.shape[1] != W or t.shape[-1] != D:
                    raise ValueError(
                        f"rotary cos/sin (or a RotaryPairs table) must have shape [1, {W}, 1, {D}] to match out, got {tuple(t.shape)}"
                    )
        if segments.src_end > T:
            raise ValueError(f"a segment reads tokens up to {segments.src_end}, past the storage capacity {T}")
        if segments.dst_end > out.shape[1]:
            raise ValueError(f"a segment writes tokens up to {segments.dst_end}, past the workspace length {out.shape[1]}")
        if segments.slot_end > storage.num_slots:
            raise ValueError(f"a segment names slot {segments.slot_end - 1}, outside [0, {storage.num_slots})")

    def quantize(self, x: torch.Tensor, *, role: Role = "value", warm_start: Packed | None = None) -> Packed:
        """Pack one tensor as a single segment (``quantize_into`` checks the values)."""
        self.check_layout(x)
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
