"""The QVG encoder's driver, and its PyTorch reference: k-means smoothing stages, then residual codes.

The reference computes everything first and writes last, so a failing call leaves the storage as it was;
the Triton encoder (:mod:`.triton.encoder`) packs a batch of writes in one launch sequence.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...rotary import compute_dtype_for
from ..base import HeadSlice, Packed
from ..groups import pow2_at_least
from ..status import WriteStatus
from .decode import decode_centroids
from .format import QVGPacked, pack_codes
from .kmeans import assign, gather_rows, kmeans_init, lloyd
from .residual import quantize_residual
from .settings import QVGSettings
from .write import Write

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def round_centroids(centroids: torch.Tensor, config: QVGSettings) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Centroids [P, K, D] in the storage dtype, and their float32 power-of-two scales for e4m3.

    An e4m3 scale is ``2^ceil(log2(amax / 448))`` per centroid (or per head), so no value saturates.
    """
    if config.centroid_dtype != "e4m3":
        return centroids.to(config.centroid_torch_dtype), None
    dims = (-1,) if config.centroid_scale == "centroid" else (-2, -1)
    scales = pow2_at_least(centroids.abs().amax(dim=dims) / E4M3_MAX)  # [P, K] or [P]
    scales = scales.reshape(centroids.shape[0], -1)  # [P, K or 1]
    stored = (centroids / scales.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return stored, scales.to(torch.float32)


def check_warm_start(
    config: QVGSettings, storage: QVGPacked, warm_start: Packed, warm_slot: int
) -> tuple[torch.Tensor, str]:
    """Raise before anything is written if ``warm_start``/``warm_slot`` cannot seed this segment.

    Returns what only the device knows (was the slot written?) as a boolean scalar and its error message,
    for :meth:`~diffusers_qvg.CodecConfig.check_values` to read in the call's one sync.
    """
    if not isinstance(warm_start, QVGPacked):
        raise TypeError(f"warm_start must be QVG storage (QVGPacked), got {type(warm_start).__name__}")
    B, _, H, D = storage.shape
    wB, _, wH, wD = warm_start.shape
    wcfg = warm_start.config
    if (wB, wH, wD) != (B, H, D) or wcfg.stages < config.stages or wcfg.centroids != config.centroids:
        raise ValueError(
            f"warm_start holds {wcfg.stages} stages of {wcfg.centroids} centroids for batch/heads/head_dim "
            f"{(wB, wH, wD)}; this segment needs {config.stages} stages of {config.centroids} for {(B, H, D)}"
        )
    if warm_start.device != storage.device:
        raise ValueError(f"warm_start is on {warm_start.device} but the storage is on {storage.device}")
    if not 0 <= warm_slot < warm_start.num_slots:
        raise ValueError(f"warm_slot {warm_slot} is outside the warm_start storage's {warm_start.num_slots} slots")
    written = (warm_start.scale_shift[warm_slot] > 0).all()
    return written, f"warm_slot {warm_slot} of warm_start was never written; warm-start from a packed segment"


def quantize_writes(
    config: QVGSettings,
    writes: Sequence[Write],
    status: WriteStatus | None = None,
    checks: Sequence[tuple[str, Sequence[str]]] | None = None,
    holds: torch.Tensor | None = None,
    *,
    triton: bool,
    heads: HeadSlice | None = None,
) -> None:
    """Pack ``writes`` (validated by :meth:`QVGConfig.quantize_batch_into`): the Triton encoder (``triton``: see
    :func:`.backend.use_triton_encoder`) packs them all in one launch sequence; the reference packs them one
    by one. ``heads``: which of the model's heads they hold (the k-means inits draw per global head).

    With a ``status``: for the reference each write was checked (:meth:`WriteStatus.check`) and write ``i``
    stores only while ``status.allows(seq_i)``, read on the host; the Triton encoder checks the values itself
    (``checks``: each write's name and condition messages; ``holds``: bool [I, 1], False where a write's
    warm-start condition fails) and gates every store on the device, by the same rule.
    """
    if triton:
        from .triton.encoder import encode

        encode(config, writes, status, checks, holds, heads)
        return
    for write in writes:
        if status is None or bool(status.allows(write.seq)):  # free on the CPU; a sync on CUDA
            reference_write(config, write, heads)


def reference_write(config: QVGSettings, write: Write, heads: HeadSlice | None = None) -> None:
    """Pack one write with the PyTorch reference. Everything is computed first and written last."""
    storage, x, token_start, slot, _, warm = write
    B, N, H, D = x.shape
    K, f = config.centroids, compute_dtype_for(x.dtype)
    points = x.to(f).permute(0, 2, 1, 3).reshape(B * H, N, D)  # one k-means problem per (batch, head)
    stages = []  # (stored centroids, centroid scales, ids) per stage
    for t in range(config.stages):
        if warm is not None:
            warm_start, warm_slot = warm
            wscales = None if warm_start.centroid_scales is None else warm_start.centroid_scales[warm_slot, t]
            init = decode_centroids(warm_start.centroids[warm_slot, t], wscales, f).reshape(B * H, K, D)
        else:
            generator = torch.Generator(device=x.device).manual_seed(config.seed + t)
            init = kmeans_init(points, K, config.kmeans_init, generator, heads)
        centroids = lloyd(points, init, config.kmeans_iters, config.kmeans_precision)
        stored, scales = round_centroids(centroids, config)
        table = decode_centroids(stored, scales, f)
        ids = assign(points, table)
        points = points - gather_rows(table, ids)
        stages.append((stored, scales, ids))

    codes = quantize_residual(points.reshape(B, H, N, D).transpose(1, 2), config)
    tokens = slice(token_start, token_start + N)
    storage.codes[:, tokens] = pack_codes(codes.u, config)
    storage.scales[:, tokens] = codes.scales
    if storage.zeros is not None:
        storage.zeros[:, tokens] = codes.zeros
    storage.scale_shift[slot] = codes.shift
    write_stages(storage, stages, tokens, slot)


def write_stages(storage: QVGPacked, stages: list, tokens: slice, slot: int) -> None:
    """Store each stage's centroids (and scales) in ``slot`` and its ids at ``tokens``."""
    B, _, H, D = storage.shape
    N = tokens.stop - tokens.start
    for t, (stored, scales, ids) in enumerate(stages):
        storage.centroids[slot, t] = stored.reshape(B, H, -1, D)
        if scales is not None:
            storage.centroid_scales[slot, t] = scales.reshape(B, H, -1)
        storage.ids[:, tokens, :, t] = ids.reshape(B, H, N).transpose(1, 2).to(storage.ids.dtype)
