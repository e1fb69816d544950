"""Host reads of device memory per chunk of the real pipeline: none in a denoising forward, one per clean pass.
With qvg-int2 storage on the Triton path (the CUDA code path; its interpreter here) the same, and the
Triton launches per layer stay within issue 8's bounds: one window read per layer-forward, one launch
sequence of the batched encoder per group of ``CacheConfig.encode_layers`` layers (their K and V together)
in a clean pass.

On the CPU a device sync cannot be seen, so every host read is counted instead (``aten._local_scalar_dense``,
``is_nonzero``, ops with data-dependent output shapes, ``Tensor.tolist``), inside the cache's chunk blocks
(the scheduler's own reads between them are diffusers', the same with any cache). On CUDA each of them
would be a sync. The one read of a clean-context pass is the cache's write status, read when its block ends.
"""

import dataclasses
import math
from contextlib import contextmanager, nullcontext

import pytest
import torch
from launch_counts import counting_launches
from torch.utils._python_dispatch import TorchDispatchMode

import diffusers_qvg as dq
from diffusers_qvg.codecs.qvg import backend
from diffusers_qvg.pipelines import QVGCausalWanPipeline, tiny_components

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS or torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_blocks(cache: dq.QVGCache, monkeypatch):
    """Host reads of each chunk block, as (final, reads)."""
    blocks, chunk, tolist = [], cache.chunk, torch.Tensor.tolist

    @contextmanager
    def counted(start_frame, final=False, **kwargs):
        mode = HostReads()
        with mode:
            with chunk(start_frame, final, **kwargs) as c:
                yield c
        blocks.append((final, mode.count))

    def counted_tolist(self):  # tolist reads without dispatching an op
        for mode in torch.utils._python_dispatch._get_current_dispatch_mode_stack():
            if isinstance(mode, HostReads):
                mode.count += 1
        return tolist(self)

    monkeypatch.setattr(cache, "chunk", counted)
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    yield blocks


@torch.no_grad()
@pytest.mark.parametrize("kv_cache", ["bf16", "bf16 in place", "qvg-int2", "qvg-int2 per layer"])
def test_denoising_forwards_read_nothing_and_a_clean_pass_reads_once(kv_cache, monkeypatch):
    pipe = QVGCausalWanPipeline(**tiny_components(seed=0))
    pipe.set_progress_bar_config(disable=True)
    layers = len(pipe.transformer.blocks)
    qvg = kv_cache.startswith("qvg-int2")
    storage = dq.QVGConfig(num_centroids=8, kmeans_iters=1) if qvg else "bf16"
    state = pipe.stream(prompt="a fox", height=32, width=32, num_frames=33, kv_cache=storage, window_frames=6,
                        keys_before_rope=kv_cache != "bf16 in place", output_type="latent")
    assert state.cache.config.in_place == (kv_cache == "bf16 in place")
    if kv_cache == "qvg-int2 per layer":
        state.cache.reset(dataclasses.replace(state.cache.config, encode_layers=1))
    assert layers < state.cache.config.encode_layers or kv_cache != "qvg-int2"  # the default: one group
    with state, counting_blocks(state.cache, monkeypatch) as blocks, counting_launches() as names:
        with backend("triton") if qvg else nullcontext():
            list(state)
    assert [final for final, _ in blocks] == [False] * 4 + [True] + [False] * 4 + [True] + [False] * 4 + [True]
    assert [reads for final, reads in blocks if not final] == [0] * 12
    assert [reads for final, reads in blocks if final] == [1] * 3
    if not qvg:
        assert names == []
        return
    # 3 chunks: the first window holds nothing packed (no read), then one window read per layer-forward
    # (5 forwards per chunk), and one encoder launch sequence per group of layers per clean pass.
    sequence = state.cache.config.storage.stages * (1 + 2 * 1 + 2) + 1  # (init, 1 x (assign, update), round, final), codes
    groups = math.ceil(layers / state.cache.config.encode_layers)
    assert names.count("_window_kernel") == 2 * 5 * layers
    assert len(names) - names.count("_window_kernel") == 3 * groups * sequence
