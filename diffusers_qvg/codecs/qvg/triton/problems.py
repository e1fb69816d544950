"""The k-means problems of one encoder call, and how every encoder kernel reads their points.

A call packs ``I`` items (tensors ``x`` [B, N, H, D] of one shape, each into its own storage, token range and
slot: e.g. a layer's K and V); each (item, batch, head) is one problem of N points, ``P = I * B * H`` in all,
item-major. The kernels take item 0's tensors as base pointers and an int64 *item table* [I, COLUMNS] on the
device: each item's element offsets from item 0's tensors, then its token start and slot. So one
launch covers every item, token starts and slots never become kernel arguments (no recompiles), and the
number of launches does not depend on I.

Between launches the problems share scratch, problem-major: the working float32 centroids of the Lloyd
iterations, the centroid update's compacted tokens, each stage's rounded table (stored bits, exactly what the storage will hold, and its scales) and
ids, each head's residual scale need, which the codes kernel turns into its shift, and each item's largest
magnitude, the write check the codes kernel applies. The points of stage
``t`` are never materialised: ``x - C_0[id_0] - ... - C_{t-1}[id_{t-1}]`` (float32, in that order, as the
reference subtracts them) is recomputed by every kernel that reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .numerics import round_to_bf16, round_to_tf32

# Columns of the item table.
X, CODES, SCALES, ZEROS, IDS, CENT, CSCALE, SHIFT, TOKEN_START, SLOT = (tl.constexpr(i) for i in range(10))
COLUMNS = tl.constexpr(10)
GRID_AXIS = 65535  # the most programs a CUDA grid's second and third axes take
# Tokens per problem below which the centroid update's int32 members (token x 32 + centroid in its block) fit.
MAX_TOKENS = 2**26
STORAGE_FIELDS = ("codes", "scales", "zeros", "ids", "centroids", "centroid_scales", "scale_shift")


@dataclass
class Problems:
    """Geometry, item table and scratch of one encoder call (see the module docstring)."""

    x: torch.Tensor  # item 0's points: [B, N, H, D] (or a [P, N, D] tensor seen as B = P, H = 1)
    x_strides: tuple[int, int, int, int]
    items: torch.Tensor  # int64 [I, COLUMNS]
    num_items: int
    batch: int
    tokens: int
    heads: int
    head_dim: int
    centroids: int  # K
    ids: torch.Tensor  # int32 [stages, P, N]
    tables: torch.Tensor  # [stages, P, K, D] in the storage's centroid dtype
    table_scales: torch.Tensor  # float32 [stages, P, K or 1] (e4m3 tables), else a dummy
    working: torch.Tensor  # float32 [P, K, D]: the Lloyd iterations' centroids
    operands: torch.Tensor  # [P, K, D]: the working centroids as the next assignment multiplies them
    norms: torch.Tensor  # float32 [P, K]: their squared norms
    need: torch.Tensor  # float32 [P]: each head's largest scale need (before its shift)
    magnitude: torch.Tensor  # float32 [I]: each item's largest |x| (+inf if any value is NaN/Inf), for the check
    x_align: int = 1  # elements every problem's first point is aligned to (see alignment())
    sweeps: int = 0  # launches so far that read every problem's points (see sweep())
    members: torch.Tensor | None = None  # int32 [P * centroid blocks, N]: the update's compacted tokens
    previous: torch.Tensor | None = None  # int32 [P, N]: each Lloyd assignment's ids before it (see lloyd_scratch)
    sums: torch.Tensor | None = None  # float32 [P, K, D]: the clusters' sums, kept for the next update
    counts: torch.Tensor | None = None  # int32 [P, K]: their sizes

    @property
    def holds_table(self) -> bool:
        """Whether the operand scratch holds a decoded stage table exactly (float32 operands, or bf16 ones and
        an e4m3 or bf16 table), so that the rounding kernel can leave it for the final assignment."""
        return self.operands.dtype == torch.float32 or exact_format(self.tables.dtype) == "bf16"

    def member_rows(self, blocks: int) -> torch.Tensor:
        """The centroid update's scratch: one row of N tokens per (problem, block of ``blocks``), made once."""
        if self.members is None or self.members.shape[0] != self.count * blocks:
            self.members = torch.empty(self.count * blocks, self.tokens, dtype=torch.int32, device=self.x.device)
        return self.members

    def lloyd_scratch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the Lloyd iterations carry from one to the next, made once: the ids before each assignment
        (:attr:`previous`), the clusters' float32 sums and their sizes (:mod:`.centroid_update`)."""
        if self.previous is None:
            P, N, K, D = self.count, self.tokens, self.working.shape[1], self.head_dim
            device = self.x.device
            self.previous = torch.empty(P, N, dtype=torch.int32, device=device)
            self.sums = torch.empty(P, K, D, dtype=torch.float32, device=device)
            self.counts = torch.empty(P, K, dtype=torch.int32, device=device)
        return self.previous, self.sums, self.counts

    @property
    def count(self) -> int:
        return self.batch_rows * self.heads

    @property
    def batch_rows(self) -> int:
        """Items x batch: the launch grid's third axis."""
        return self.num_items * self.batch

    def grid(self, blocks: int) -> tuple[int, int, int]:
        """A launch grid of ``blocks`` programs per problem (:func:`grid_problem` reads it)."""
        return blocks, self.heads, self.batch_rows

    def point_args(self, reverse: int = 0) -> tuple:
        """The arguments every encoder kernel starts with (see :func:`stage_points`); ``reverse`` (0 or 1, from
        :meth:`sweep`) is the order its programs take the problems in (:func:`grid_problem`)."""
        return (
            self.x, self.items, self.ids, self.tables, self.table_scales,
            self.tokens, self.centroids, self.count, self.heads, self.batch, reverse, *self.x_strides,
        )  # fmt: skip

    def sweep(self) -> int:
        """The order of the next launch that reads every problem's points: the reverse of the previous such
        launch's. A GPU starts a launch's programs in grid order, so a launch ends on the problems whose
        points are the newest in L2, and the next one, run backwards, starts on them: a layer group's K and V
        (86 MB at Wan2.1-1.3B, 3 layers) is more than an H200's 60 MB of L2, which a pass in one order would
        evict ahead of every read (docs/benchmarks.md, "The encoder's memory traffic")."""
        order = self.sweeps % 2
        self.sweeps += 1
        return order

    def check_offsets(self) -> None:
        """Per-element offsets in the kernels are int32: a problem's points must span less than 2^31 elements;
        the strided init's ``k * N`` is unsigned 32-bit (:func:`strided_tokens`); the centroid update packs a
        member's token and its place in a block of centroids into one int32 (``N < MAX_TOKENS``); the launch
        grid (:meth:`grid`) holds the heads and the items x batch rows on axes of at most 65,535."""
        N, D = self.tokens, self.head_dim
        if self.heads > GRID_AXIS or self.batch_rows > GRID_AXIS:
            raise ValueError(
                f"{self.num_items} items x batch {self.batch} ({self.batch_rows} rows) of {self.heads} heads: the "
                f"Triton encoder's launch grid takes at most {GRID_AXIS} of each: write fewer items or batch rows "
                "at once"
            )
        if N >= MAX_TOKENS:
            raise ValueError(
                f"a segment of {N} tokens is too long for the Triton encoder (at most {MAX_TOKENS - 1} per "
                "segment and head): pack shorter segments"
            )
        if (self.centroids - 1) * N >= 2**32:
            raise ValueError(
                f"a segment of {N} tokens with {self.centroids} centroids needs (centroids - 1) x tokens < 2^32 "
                "for the Triton encoder's strided init: pack shorter segments or use fewer centroids"
            )
        span = (N - 1) * abs(self.x_strides[1]) + (D - 1) * abs(self.x_strides[3])
        if span >= 2**31:
            raise ValueError(
                f"a segment of {N} tokens spans {span} elements per head (token stride {self.x_strides[1]}); the "
                "Triton encoder needs fewer than 2^31: pack shorter segments"
            )

    def flags(self) -> dict:
        """Constexprs every encoder kernel takes: how the stage tables decode (``CENT_SCALED``: e4m3 with
        scales, per centroid or not) and ``X_ALIGN``."""
        scaled = self.table_scales.dim() == 3
        return dict(CENT_SCALED=scaled, PER_CENTROID=scaled and self.table_scales.shape[-1] > 1, X_ALIGN=self.x_align)


def alignment(xs: list[torch.Tensor], strides: tuple[int, ...]) -> int:
    """The largest power of two (at most 16 bytes' worth of elements) dividing the element address of every
    item's first point and the batch and head strides: every problem's first point is aligned to it, which
    the kernels state (``X_ALIGN``) so that loads from it vectorise. The item offsets come from device memory,
    where the compiler cannot see their alignment."""
    size = xs[0].element_size()
    values = [x.data_ptr() // size for x in xs] + [s for s in strides if s]
    align = 16 // size
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


def exact_format(dtype: torch.dtype) -> str | None:
    """The narrowest tensor-core input format holding every value of ``dtype`` exactly: "bf16" (bf16, e4m3),
    "tf32" (fp16: 10 mantissa bits), or None (float32)."""
    if dtype in (torch.bfloat16, torch.float8_e4m3fn):
        return "bf16"
    return "tf32" if dtype == torch.float16 else None


def operand_dtype(precision: str) -> torch.dtype:
    """The dtype the assignment's centroid operands are kept in between launches (bf16 values fit bf16)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def points_problems(x: torch.Tensor, num_centroids: int, precision: str = "tf32x3") -> Problems:
    """A [P, N, D] float tensor of points as a one-item problem set (B = P, H = 1), for the k-means kernels
    on their own (tests, benchmarks); no stage tables."""
    P, N, D = x.shape
    dummy = torch.zeros(1, 1, 1, device=x.device)
    problems = Problems(
        x=x, x_strides=(x.stride(0), x.stride(1), 0, x.stride(2)),
        items=torch.zeros(1, COLUMNS.value, dtype=torch.int64, device=x.device),
        num_items=1, batch=P, tokens=N, heads=1, head_dim=D, centroids=num_centroids,
        ids=torch.empty(1, P, N, dtype=torch.int32, device=x.device), tables=dummy, table_scales=dummy.view(1),
        working=torch.empty(P, num_centroids, D, device=x.device), need=dummy.view(1), magnitude=dummy.view(1),
        operands=torch.empty(P, num_centroids, D, dtype=operand_dtype(precision), device=x.device),
        norms=torch.empty(P, num_centroids, device=x.device),
        x_align=alignment([x], (x.stride(0),)),
    )  # fmt: skip
    problems.check_offsets()
    return problems


@triton.jit
def grid_problem(heads, batch, reverse):
    """(p, item, b, h) of this program on a problem grid (:meth:`Problems.grid`: axis 1 the head, axis 2 the
    item and batch row; problems are item-major, then batch, then head), with ``p`` int64: one integer
    division per program, where splitting a flat problem index takes three. With ``reverse`` (1) the grid
    takes the problems last first (:meth:`Problems.sweep`)."""
    h = tl.program_id(1)
    ib = tl.program_id(2)
    h += reverse * (heads - 1 - 2 * h)
    ib += reverse * (tl.num_programs(2) - 1 - 2 * ib)
    item = ib // batch
    return ib.to(tl.int64) * heads + h, item, ib - item * batch, h


@triton.jit
def item_value(items_ptr, item, COLUMN: tl.constexpr):
    return tl.load(items_ptr + item * COLUMNS + COLUMN)


@triton.jit
def problem_points(x_ptr, items_ptr, item, b, h, s_x_b, s_x_h, X_ALIGN: tl.constexpr):
    """Pointer to the first point of problem (item, b, h), aligned to ``X_ALIGN`` elements. Per-element
    offsets from it stay int32 (``N * s_x_t < 2^31``, checked on the host): one 64-bit base per program, not
    one address per element."""
    return x_ptr + tl.multiple_of(item_value(items_ptr, item, X) + b * s_x_b + h * s_x_h, X_ALIGN)


@triton.jit
def stage_rows(
    tables_ptr, tscales_ptr, t, p, ids, row_mask, cols, col_mask, n_centroids, n_problems,
    D: tl.constexpr, CENT_SCALED: tl.constexpr, PER_CENTROID: tl.constexpr,
):
    """Stage ``t``'s decoded table rows ``ids`` (int32) of problem ``p``: ``float(stored) * scale``, float32,
    0 where masked (the reference's ``decode_centroids``, exact). Like every point helper here it takes its
    row and column indices (``ids``, ``row_mask``; ``cols``, ``col_mask``) already broadcast to the result's
    rank: [BLOCK, 1] and [1, D_PAD] for a [BLOCK, D_PAD] tile, or any other arrangement a kernel's
    reductions want."""
    table = (t * n_problems + p) * n_centroids
    mask = row_mask & col_mask
    # No `other=` (it cannot be cast to fp8); masked lanes are zeroed after the widening instead.
    stored = tl.load(tables_ptr + table * D + (ids * D + cols), mask=mask)
    rows = tl.where(mask, stored.to(tl.float32), 0.0)
    if CENT_SCALED:
        if PER_CENTROID:
            rows = rows * tl.load(tscales_ptr + table + ids, mask=row_mask, other=0)
        else:
            rows = rows * tl.load(tscales_ptr + t * n_problems + p)
    return rows


@triton.jit
def operand_rows(op_ptr, p, ids, row_mask, cols, col_mask, n_centroids, D: tl.constexpr):
    """Rows ``ids`` (int32) of problem ``p``'s operand scratch as float32, 0 where masked (indices broadcast as
    for :func:`stage_rows`): the last stage's decoded table exactly, where the rounding kernel left it there
    (:attr:`Problems.holds_table`), in bf16 half the bytes of float32 and a cheaper widening than e4m3 times
    its scale."""
    rows = tl.load(op_ptr + p * n_centroids * D + (ids * D + cols), mask=row_mask & col_mask, other=0)
    return rows.to(tl.float32)


@triton.jit
def stage_inputs(x_row, tokens, row_mask, cols, col_mask, s_x_t, s_x_d):
    """Points ``tokens`` of the problem at ``x_row`` (see :func:`problem_points`) at stage 0, in the input's own
    dtype, 0 where masked (indices broadcast as for :func:`stage_rows`)."""
    return tl.load(x_row + (tokens * s_x_t + cols * s_x_d), mask=row_mask & col_mask, other=0)


@triton.jit
def stage_points(
    x_row, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, s_x_t, s_x_d,
    p, tokens, row_mask, cols, col_mask,
    STAGE: tl.constexpr, D: tl.constexpr, CENT_SCALED: tl.constexpr, PER_CENTROID: tl.constexpr,
):
    """Points ``tokens`` of problem ``p`` (int64; its first point at ``x_row``) at stage ``STAGE``: x minus
    the first STAGE stages' centroids, float32, 0 where masked (indices broadcast as for :func:`stage_rows`)."""
    r = stage_inputs(x_row, tokens, row_mask, cols, col_mask, s_x_t, s_x_d).to(tl.float32)
    for t in tl.static_range(STAGE):
        ids = tl.load(ids_ptr + (t * n_problems + p) * n_points + tokens, mask=row_mask, other=0)
        r = r - stage_rows(
            tables_ptr, tscales_ptr, t, p, ids, row_mask, cols, col_mask, n_centroids, n_problems,
            D, CENT_SCALED, PER_CENTROID,
        )
    return r


@triton.jit
def strided_tokens(ks, n_points, n_centroids):
    """The tokens ``floor(k * N / K)`` the strided init takes as centroids ``ks`` (int32, as torch computes), in
    unsigned 32-bit arithmetic (``(K - 1) N < 2^32``, :meth:`Problems.check_offsets`): a 64-bit division is
    a software routine on a GPU, four times the instructions."""
    return ((ks.to(tl.uint32) * n_points.to(tl.uint32)) // n_centroids.to(tl.uint32)).to(tl.int32)


@triton.jit
def working_rows(
    x_row, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, s_x_t, s_x_d,
    cent_ptr, s_c_p, s_c_k, s_c_d, p, ks, k_mask, cols, col_mask,
    STAGE: tl.constexpr, FROM_POINTS: tl.constexpr, D: tl.constexpr,
    CENT_SCALED: tl.constexpr, PER_CENTROID: tl.constexpr,
):
    """Working centroids ``ks`` of problem ``p`` (float32, 0 where masked; indices broadcast as for
    :func:`stage_rows`): the strided init's points when ``FROM_POINTS`` (the first iteration of a stage), else
    the working table."""
    if FROM_POINTS:
        return stage_points(
            x_row, ids_ptr, tables_ptr, tscales_ptr, n_points, n_centroids, n_problems, s_x_t, s_x_d,
            p, strided_tokens(ks, n_points, n_centroids), k_mask, cols, col_mask, STAGE, D, CENT_SCALED, PER_CENTROID,
        )
    else:
        return tl.load(cent_ptr + p * s_c_p + (ks * s_c_k + cols * s_c_d), mask=k_mask & col_mask, other=0)


@triton.jit
def lloyd_operand(v, PRECISION: tl.constexpr):
    """``v`` (float32) rounded to nearest-even in the Lloyd assignment's input format (a no-op for tf32x3)."""
    if PRECISION == "bf16":
        return round_to_bf16(v)
    elif PRECISION == "tf32":
        return round_to_tf32(v)
    else:
        return v


@triton.jit
def exact_dot(a, b, acc, FORMAT: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc + a @ b`` for float32 operands whose values are exact in ``FORMAT`` ("bf16", "fp16", "tf32"),
    so every product is exact and only the float32 accumulation order is the hardware's; "tf32x3" for
    any float32 operands (about float32 accuracy). The interpreter's dot mishandles bfloat16 operands, so
    there (``INTERPRET``) the same exact values are multiplied in float32."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif FORMAT == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif FORMAT == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    else:
        return tl.dot(a, b, acc, input_precision=FORMAT)

