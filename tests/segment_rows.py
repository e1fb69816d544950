"""Segment tables the decoder tests share."""

import torch

LENGTHS = [1, 7, 3, 9, 1, 2, 5, 11, 1]  # 40 tokens in 9 segments


def gapped_rows(window: int = 60, slots: int = 9) -> list[tuple[int, int, int, int]]:
    """40 stored tokens in 9 segments written back to front into a ``window``, with gaps between some."""
    rows, src, dst = [], 0, window
    for i, n in enumerate(LENGTHS):
        dst -= n + (i % 2)
        rows.append((src, n, dst, (i * 4) % slots))
        src += n
    return rows


def uncovered(rows, window: int, device) -> torch.Tensor:
    """The window's tokens no row writes (a bool mask)."""
    covered = torch.zeros(window, dtype=torch.bool, device=device)
    for _, n, d, _ in rows:
        covered[d : d + n] = True
    return ~covered
