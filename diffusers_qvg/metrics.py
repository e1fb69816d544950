"""Error measures shared by tests and benchmarks: one definition of each figure we report."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rel_l2(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """``||approx - reference|| / ||reference||`` over all elements, in float64."""
    if reference.shape != approx.shape:
        raise ValueError(f"shapes differ: reference {tuple(reference.shape)} vs approx {tuple(approx.shape)}")
    ref = reference.double()
    return (approx.double() - ref).norm().item() / ref.norm().item()


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``softmax(Q K^T / sqrt(d)) V`` for [B, tokens, heads, head_dim] inputs, in float32, no mask.

    Queries attend to every key, as a chunk's queries do to its cached context window.
    """
    q, k, v = (t.float().transpose(1, 2) for t in (query, key, value))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)

