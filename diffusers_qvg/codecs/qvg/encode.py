"""Reference QVG encoder in PyTorch: k-means smoothing stages, then residual codes (``/work/encoder_spec.md``).

Everything is computed first and written last, so a failing call leaves the storage as it was.
"""

from __future__ import annotations

import torch

from ...rotary import compute_dtype_for
from ..base import HeadSlice, Packed
from ..status import WriteStatus
from ..groups import pow2_at_least
from .config import QVGConfig
from .decode import decode_centroids
from .format import QVGPacked, pack_codes
from .backend import encoder_ops
from .kmeans import gather_rows, kmeans_init
from .residual import quantize_residual

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def round_centroids(centroids: torch.Tensor, config: QVGConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    config: QVGConfig, storage: QVGPacked, warm_start: Packed, warm_slot: int
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


def quantize_into(
    config: QVGConfig,
    storage: QVGPacked,
    x: torch.Tensor,
    *,
    token_start: int,
    slot: int,
    warm_start: Packed | None = None,
    warm_slot: int = 0,
    gate: WriteStatus | None = None,
    heads: HeadSlice | None = None,
) -> None:
    """Pack ``x`` [B, N, H, D] into ``storage`` tokens ``[token_start, token_start + N)`` and ``slot``.

    The caller (:meth:`QVGConfig.quantize_into`) has validated ``x``, ``warm_start`` and ``heads`` against the
    storage; with a ``gate``, the values were checked on the device only, and nothing may be written unless
    ``gate.ok()``. ``heads``: which of the model's heads ``x`` holds (the k-means init draws per global head).
    """
    B, N, H, D = x.shape
    K, f = config.centroids, compute_dtype_for(x.dtype)

    ops = encoder_ops(config, x)
    points = x.to(f).permute(0, 2, 1, 3).reshape(B * H, N, D)  # one k-means problem per (batch, head)
    stages = []  # (stored centroids, centroid scales, ids) per stage
    for t in range(config.stages):
        if warm_start is not None:
            wscales = None if warm_start.centroid_scales is None else warm_start.centroid_scales[warm_slot, t]
            init = decode_centroids(warm_start.centroids[warm_slot, t], wscales, f).reshape(B * H, K, D)
        else:
            generator = torch.Generator(device=x.device).manual_seed(config.seed + t)
            init = kmeans_init(points, K, config.kmeans_init, generator, heads)
        stored, scales = round_centroids(ops.lloyd(points, init, config.kmeans_iters), config)
        table = decode_centroids(stored, scales, f)
        ids = ops.assign(points, table).long()
        if ops.write_residual is None or t + 1 < config.stages:  # the kernel subtracts the last stage itself
            points = points - gather_rows(table, ids)
        stages.append((stored, scales, ids))

    tokens = slice(token_start, token_start + N)
    if gate is not None and not gate.ok_on_host():
        return  # a failed write stores nothing
    if ops.write_residual is not None:
        write_stages(storage, stages, tokens, slot)  # the residual kernel reads them back from the storage
        ops.write_residual(storage, x, token_start=token_start, slot=slot)
        return

    residual = points.reshape(B, H, N, D).transpose(1, 2)
    codes = quantize_residual(residual, config)
    packed_codes = pack_codes(codes.u, config)

    storage.codes[:, tokens] = packed_codes
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
