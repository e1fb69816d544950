"""The encoder calls that docs/benchmarks.md profiles with ``../shared/tools/sm90_profile.py --call``.

    python ../shared/tools/sm90_profile.py --call scripts/prof_calls.py:kv_batch_traceable

Each is one cache write as the clean-context pass makes it (the Triton path, a write status), on Wan2.1-1.3B's
chunk shape [1, 4680, 12, 128] bf16. The items are views of one tensor written into the slots of one storage:
the same kernels and grids as separate storages, laid out so that the tool's interpreter trace can follow the
item table's offsets.
"""

from __future__ import annotations

import torch

from diffusers_qvg.codecs.qvg import QVGConfig
from diffusers_qvg.codecs.kernel_backend import backend
from diffusers_qvg.codecs.status import WriteStatus

TOKENS, HEADS, HEAD_DIM = 4680, 12, 128


def batch_write(config: QVGConfig, layers: int) -> None:
    """``layers`` layers' K and V in one ``quantize_batch_into`` call."""
    items = 2 * layers
    kv = torch.randn(items, 1, TOKENS, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    storage = config.allocate(batch=1, capacity_tokens=items * TOKENS, heads=HEADS, head_dim=HEAD_DIM, num_slots=items,
                              dtype=torch.bfloat16, device="cpu")  # fmt: skip
    with backend("triton"):
        config.quantize_batch_into([(storage, kv[i], i * TOKENS, i) for i in range(items)], status=WriteStatus("cpu"))


def kv_batch_traceable() -> None:
    """One layer's K and V (``CacheConfig(encode_layers=1)``)."""
    batch_write(QVGConfig(), 1)


def kv3_batch_traceable() -> None:
    """A layer group's K and V (the default ``CacheConfig.encode_layers=3``)."""
    batch_write(QVGConfig(), 3)


def kv3_coarse_traceable() -> None:
    """The same with the coarse scale search (``scale_search="mse-coarse"``)."""
    batch_write(QVGConfig(scale_search="mse-coarse"), 3)


def int4_asym_traceable() -> None:
    """One layer's K and V in INT4 asymmetric codes with fp16 scales: 16-token programs, whose groups span
    threads (docs/benchmarks.md, "A thread per group")."""
    batch_write(QVGConfig(bits=4, symmetric=False, scale_dtype="fp16"), 1)
