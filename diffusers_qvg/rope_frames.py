"""Wan RoPE tables at a frame offset, gathered from the transformer's own ``rope`` module.

``WanRotaryPosEmbed`` always numbers frames from 0; a chunk that starts at frame ``f`` must be rotated as
frames ``f, f+1, ...``. The tables below are *gathered* from the module's own frequency buffers, exactly as
its forward slices them, so the values are bit-identical to what the stock module returns for the same
frames (no arithmetic happens here).
"""

from __future__ import annotations

import torch


def wan_rope_for_frames(
    rope: torch.nn.Module, frame_ids: list[int], height: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each [1, len(frame_ids) * height * width, 1, head_dim], for patch tokens in frame-major order.

    ``frame_ids`` are (post-patch) frame positions on the host, below ``rope.max_seq_len`` (a cache re-bases a
    window that runs past it: ``diffusers_qvg.cache.plan.window_positions``); ``height``/``width`` are post-patch
    sizes.
    """
    if max(frame_ids) >= rope.max_seq_len or min(frame_ids) < 0:
        raise ValueError(
            f"frame positions {min(frame_ids)}..{max(frame_ids)} are outside the transformer's RoPE "
            f"table (rope_max_seq_len={rope.max_seq_len})"
        )
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    device = rope.freqs_cos.device
    frame_ids = torch.tensor(frame_ids, dtype=torch.long)
    if device.type == "cuda":  # from pinned memory without blocking: planning a chunk never syncs
        frame_ids = frame_ids.pin_memory().to(device, non_blocking=True)
    else:
        frame_ids = frame_ids.to(device)
    tables = []
    for freqs in (rope.freqs_cos, rope.freqs_sin):
        f_t, f_h, f_w = freqs.split(split, dim=1)
        n = len(frame_ids)
        parts = (
            f_t.index_select(0, frame_ids).view(n, 1, 1, -1).expand(n, height, width, -1),
            f_h[:height].view(1, height, 1, -1).expand(n, height, width, -1),
            f_w[:width].view(1, 1, width, -1).expand(n, height, width, -1),
        )
        tables.append(torch.cat(parts, dim=-1).reshape(1, n * height * width, 1, -1))
    return tables[0], tables[1]


def patch_grid(rope: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[int, int, int]:
    """Frames, height and width of the transformer input [B, C, F, H, W] after ``rope``'s patching."""
    _, _, frames, height, width = hidden_states.shape
    p_t, p_h, p_w = rope.patch_size
    return frames // p_t, height // p_h, width // p_w
