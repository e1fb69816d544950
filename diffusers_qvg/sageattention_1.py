"""SageAttention 1.0.6's Triton kernels over a cache window: the 8-bit attention the benchmarks measure.

sageattention 1.0.6 (PyPI, Triton only) runs Q K^T in int8 with per-block scales and P V in fp16. diffusers'
sage backends need sageattention >= 2.1.1, a CUDA build that is not on PyPI, so the benchmarks and the FP8
window checks call these kernels directly. Its ``sageattn`` smooths K in place (``k -= k.mean(...)``), which
would rewrite a cache that attends to its own storage (the BF16 cache with rotated keys); here the mean is
taken off out of place, and the same kernels are called past ``sageattn``'s CUDA-only check, so that on a CPU
they run in Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported).
"""

from __future__ import annotations

import torch

from .codecs.kernel_backend import check_runnable

HEAD_DIMS = (64, 128)  # its head_dim-96 kernels are separate ones, not used by Wan-style models


def sageattention_1(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``softmax(Q K^T / sqrt(d)) V`` [B, n, H, D] of ``query`` [B, n, H, D] over ``key``/``value``
    [B, tokens, H, D], no mask, by SageAttention 1.0.6's kernels as ``sageattn`` runs them (K smoothed, V in fp16,
    int8 Q K per block). Inputs are rounded to bf16, as a BF16 model hands them over; the output is bf16.
    The inputs are left unchanged."""
    if query.shape[-1] not in HEAD_DIMS or not query.shape[-1] == key.shape[-1] == value.shape[-1]:
        raise ValueError(f"sageattention_1 runs head_dim {' or '.join(map(str, HEAD_DIMS))} for query, key and "
                         f"value alike; got {query.shape[-1]}, {key.shape[-1]}, {value.shape[-1]}")
    check_runnable(query, key, value, kernels="SageAttention's Triton kernels", cpu_fallback="")
    try:
        from sageattention.attn_qk_int8_per_block import forward
        from sageattention.quant_per_block import per_block_int8
    except ImportError as error:
        raise ImportError("sageattention_1 needs sageattention 1.0.6: pip install sageattention==1.0.6 "
                          "(the package's test and bench extras include it)") from error
    q, k, v = (t.to(torch.bfloat16) for t in (query, key, value))
    q = q if q.stride(-1) == 1 else q.contiguous()  # the kernels step through head_dim with stride 1
    k = k - k.mean(dim=1, keepdim=True)  # out of place: `key` may be a cache's own storage
    q8, q_scale, k8, k_scale = per_block_int8(q, k, sm_scale=None, tensor_layout="NHD")
    return forward(q8, k8, v.to(torch.float16), q_scale, k_scale, tensor_layout="NHD", output_dtype=torch.bfloat16)
