"""The Triton encoder: writes of one config and one shape (e.g. a layer's K and V) in a fixed number of launches.

For ``S`` stages of ``L`` Lloyd iterations the launches are, per stage, the strided init (when ``L > 0``),
``L`` times (assign, update), the rounding of the table and the final assignment, then the codes kernel:
``S * (2 L + 3) + 1`` (14 for the default ``QVGConfig()``; without stages, a scale-need pass and the codes
kernel; :func:`launch_count`), whatever the number of writes. Everything before the codes kernel writes only
the problem set's scratch (:mod:`.problems`); the codes kernel makes every store of the writes, gated on the
write status. Nothing reads the device on the host.

The strided init (the default) is one small launch (the update kernel's ``INIT``: 256 rows per problem
gathered, rounded and normed once), so that the first assignment's programs (37 per problem for a
4,680-token chunk) read a ready table instead of each gathering and norming it. Warm starts, ``"random"``
and ``"kmeans++"`` fill the working centroids with PyTorch ops first, each write with its own generator
seeded as the reference seeds it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Sequence

import torch

from ...groups import scale_candidates
from ..decode import decode_centroids
from ..format import QVGPacked
from ..kmeans import gather_rows, kmeans_init
from ..settings import QVGSettings
from ..write import Write
from . import check_runnable
from .assign import launch_assign
from .centroid_round import launch_round
from .centroid_update import launch_update
from .problems import COLUMNS, STORAGE_FIELDS, Problems, alignment, operand_dtype
from .quantize import launch_codes

if TYPE_CHECKING:
    from ...base import HeadSlice
    from ...status import WriteStatus


@functools.lru_cache(maxsize=16)
def scale_fractions(search: str, device: torch.device) -> torch.Tensor:
    """The scale fractions on ``device``, built once (no host-to-device copy per call)."""
    return scale_candidates(search, torch.float32, device)


def encode(
    config: QVGSettings,
    writes: Sequence[Write],
    status: "WriteStatus | None" = None,
    checks: "Sequence[tuple[str, Sequence[str]]] | None" = None,
    holds: torch.Tensor | None = None,
    heads: "HeadSlice | None" = None,
) -> None:
    """Pack every write (layouts validated by the caller). With a ``status``, the writes' values are checked
    on the device: the final assignment folds each write's largest magnitude (NaN/Inf as +inf),
    :meth:`WriteStatus.check_batch` turns them, with ``holds`` (bool [I, 1], False where a write's condition
    fails) and ``checks`` (each write's name and condition messages), into the verdict the codes kernel
    gates every store on; without, the values were checked. ``heads``: which of the model's heads the
    writes hold (random inits draw per global head)."""
    problems = build_problems(config, writes)
    need = (config.group_size, config.symmetric, config.qmax)
    check = status is not None
    strided = config.kmeans_init == "strided" and all(w.warm is None for w in writes)
    for t in range(config.stages):
        if not strided:
            fill_initial_centroids(config, writes, problems, t, heads)
        elif config.kmeans_iters:
            launch_update(problems, t, init=True, operands=config.kmeans_precision)
        for i in range(config.kmeans_iters):
            source = "operands" if i or strided else "working"
            launch_assign(problems, t, "lloyd", source=source, precision=config.kmeans_precision)
            more = i + 1 < config.kmeans_iters
            launch_update(problems, t, delta=i > 0, operands=config.kmeans_precision if more else None)
        held = problems.holds_table
        launch_round(problems, t, from_points=strided and config.kmeans_iters == 0, operands=held)
        last = t + 1 == config.stages
        source = "operands" if held else "working"
        launch_assign(problems, t, "final", source=source, need=need if last else None, check=check and last)
    if config.stages == 0:
        launch_assign(problems, 0, "none", need=need, check=check)
    allowed = None
    if status is not None:
        whats, conditions = zip(*checks)
        allowed = status.check_batch(problems.magnitude, whats, config.max_abs_input, holds, conditions).to(torch.int32)
    alphas = scale_fractions(config.scale_search, problems.x.device)
    launch_codes(problems, writes[0].storage, alphas, allowed, held=problems.holds_table)


def launch_count(config: QVGSettings) -> int:
    """The launches of one encoder call with the strided init (see the module docstring)."""
    if config.stages == 0:
        return 2
    return config.stages * (2 * config.kmeans_iters + 2 + (config.kmeans_iters > 0)) + 1


def quantize_residual_into(storage: QVGPacked, x: torch.Tensor, alphas: torch.Tensor, *, token_start: int, slot: int) -> None:
    """Rewrite a segment's residual fields from the ids and centroids it already holds (the kernel twin of the
    reference's residual quantizer, for tests and benchmarks): the scale-need pass, then the codes kernel."""
    cfg = storage.config
    problems = build_problems(cfg, [Write(storage, x, token_start, slot)])
    B, N, H, _ = x.shape
    tokens = slice(token_start, token_start + N)
    for t in range(cfg.stages):
        problems.ids[t].copy_(storage.ids[:, tokens, :, t].permute(0, 2, 1).reshape(B * H, N))
        problems.tables[t].copy_(storage.centroids[slot, t].reshape(B * H, cfg.centroids, -1))
        if storage.centroid_scales is not None:
            problems.table_scales[t].copy_(storage.centroid_scales[slot, t].reshape(B * H, -1))
    problems.need.zero_()
    launch_assign(problems, cfg.stages, "none", need=(cfg.group_size, cfg.symmetric, cfg.qmax))
    launch_codes(problems, storage, alphas)


def build_problems(config: QVGSettings, writes: Sequence[Write]) -> Problems:
    """The problem set of ``writes``: their item table (on the device, no sync) and fresh scratch."""
    first = writes[0]
    B, N, H, D = first.x.shape
    device = first.x.device
    check_runnable(*(w.x for w in writes), *(t for w in writes for t in w.storage.tensors().values()))
    xs = [w.x for w in writes]
    if any(x.stride() != first.x.stride() for x in xs):
        xs = [x.contiguous() for x in xs]  # one set of strides serves every item
    for i, w in enumerate(writes[1:], 1):
        for name in STORAGE_FIELDS:
            mine, base = getattr(w.storage, name), getattr(first.storage, name)
            if mine is not None and mine.stride() != base.stride():
                raise ValueError(
                    f"write {i}'s storage lays out {name} with strides {mine.stride()}, write 0's with "
                    f"{base.stride()}; batch only storages allocated alike (same capacity), or write them separately"
                )
    St, K, P = max(config.stages, 1), config.centroids, len(writes) * B * H
    cent_dtype = config.centroid_torch_dtype
    scaled = config.centroid_dtype == "e4m3"
    problems = Problems(
        x=xs[0], x_strides=tuple(xs[0].stride()), items=item_table(writes, xs), num_items=len(writes),
        batch=B, tokens=N, heads=H, head_dim=D, centroids=K if config.stages else 0,
        ids=torch.empty(St, P, N, dtype=torch.int32, device=device),
        tables=torch.empty(St, P, K if config.stages else 1, D, dtype=cent_dtype, device=device),
        table_scales=(
            torch.empty(St, P, K if config.centroid_scale == "centroid" else 1, device=device)
            if scaled else torch.empty(1, device=device)
        ),
        working=torch.empty(P, K if config.stages else 1, D, device=device),
        operands=torch.empty(P, K if config.stages else 1, D, dtype=operand_dtype(config.kmeans_precision), device=device),
        norms=torch.empty(P, K if config.stages else 1, device=device),
        # zeroed by the rounding kernel when there are stages
        need=torch.zeros(P, device=device) if config.stages == 0 else torch.empty(P, device=device),
        magnitude=torch.zeros(len(writes), device=device) if config.stages == 0 else torch.empty(len(writes), device=device),
        x_align=alignment(xs, xs[0].stride()[0:3:2] if B > 1 else xs[0].stride()[2:3]),
    )  # fmt: skip
    problems.check_offsets()
    return problems


def item_table(writes: Sequence[Write], xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 [I, COLUMNS]: each write's element offsets from write 0's tensors, token start and slot.

    Built on the host; on CUDA it travels from pinned memory without blocking, as segment tables do.
    """
    base = writes[0].storage

    def offset(t: torch.Tensor | None, t0: torch.Tensor | None) -> int:
        if t is None:
            return 0
        delta = t.data_ptr() - t0.data_ptr()
        if delta % t.element_size():
            raise ValueError("storage tensors must be aligned to their element size (allocate them with the codec)")
        return delta // t.element_size()

    rows = []
    for w, x in zip(writes, xs):
        zeros = w.storage.zeros if w.storage.zeros is not None else w.storage.scales
        base_zeros = base.zeros if base.zeros is not None else base.scales
        fields = [offset(getattr(w.storage, n), getattr(base, n)) for n in ("codes", "scales")]
        fields.append(offset(zeros, base_zeros))
        fields += [offset(getattr(w.storage, n), getattr(base, n)) for n in STORAGE_FIELDS[3:]]
        rows.append([offset(x, xs[0]), *fields, w.token_start, w.slot])
    host = torch.tensor(rows, dtype=torch.int64)
    assert host.shape[1] == COLUMNS.value
    device = xs[0].device
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def fill_initial_centroids(
    config: QVGSettings, writes: Sequence[Write], problems: Problems, stage: int, heads: "HeadSlice | None" = None
) -> None:
    """Working centroids for stage ``stage`` from each write's warm start, or its seeded random / k-means++
    init on its points (PyTorch; the default strided init needs none of this)."""
    B, H, K = problems.batch, problems.heads, config.centroids
    for i, w in enumerate(writes):
        rows = slice(i * B * H, (i + 1) * B * H)
        if w.warm is not None:
            warm, warm_slot = w.warm
            scales = None if warm.centroid_scales is None else warm.centroid_scales[warm_slot, stage]
            init = decode_centroids(warm.centroids[warm_slot, stage], scales, torch.float32).reshape(B * H, K, -1)
        else:
            generator = torch.Generator(device=w.x.device).manual_seed(config.seed + stage)
            init = kmeans_init(stage_points(problems, w.x, rows, stage), K, config.kmeans_init, generator, heads)
        problems.working[rows].copy_(init)


def stage_points(problems: Problems, x: torch.Tensor, rows: slice, stage: int) -> torch.Tensor:
    """One write's points at ``stage`` as float32 [B * H, N, D], from the scratch the earlier stages left
    (the reference's ``points - gather_rows(table, ids)``, in the same order)."""
    B, N, H, D = x.shape
    points = x.to(torch.float32).permute(0, 2, 1, 3).reshape(B * H, N, D)
    for t in range(stage):
        scales = problems.table_scales[t, rows] if problems.table_scales.dim() == 3 else None
        table = decode_centroids(problems.tables[t, rows], scales, torch.float32)
        points = points - gather_rows(table, problems.ids[t, rows].long())
    return points

