"""The benchmarks' device-time breakdown: launch medians, kernel families, and (CUDA) the profiler's names."""

import pytest
import torch
from launch_counts import counting_launches

import diffusers_qvg as dq
from diffusers_qvg.codecs.qvg import backend
from diffusers_qvg.device_times import by_family, device_events, launch_medians, qvg_families


def test_launch_medians_take_each_launch_median_and_refuse_different_launches():
    runs = [[("a", 1.0), ("b", 10.0)], [("a", 3.0), ("b", 30.0)], [("a", 2.0), ("b", 20.0)]]
    assert launch_medians(runs) == [("a", 2.0), ("b", 20.0)]
    assert launch_medians([]) == []
    with pytest.raises(ValueError, match="different kernels"):
        launch_medians([[("a", 1.0)], [("b", 1.0)]])


def test_by_family_sums_each_family_and_the_rest():
    families = {"read": frozenset({"_window_kernel"}), "encoder": frozenset({"_assign_kernel"})}
    events = [("_assign_kernel", 2.0), ("_window_kernel", 5.0), ("_assign_kernel", 3.0), ("ampere_gemm", 7.0)]
    assert by_family(events, families) == {
        "read": dict(us=5.0, launches=1), "encoder": dict(us=5.0, launches=2),
        "other": dict(us=7.0, launches=1), "total": dict(us=17.0, launches=4),
    }


def qvg_calls(device: str):
    """A layer's K and V written by the batched encoder, then read as a window: every kernel the cache launches."""
    config = dq.QVGConfig(num_centroids=8, kmeans_iters=1)
    g = torch.Generator().manual_seed(0)
    kv = [torch.randn(1, 64, 2, 64, generator=g).bfloat16().to(device) for _ in range(2)]
    stores = [config.allocate(batch=1, capacity_tokens=64, heads=2, head_dim=64, num_slots=1, dtype=torch.bfloat16,
                              device=device) for _ in kv]
    segments = dq.segment_table([(0, 64, 0, 0)], device=device)
    out = [torch.empty_like(t) for t in kv]

    def write():
        config.quantize_batch_into([(s, t, 0, 0) for s, t in zip(stores, kv)])

    def read():
        config.dequantize_pair_into(*stores, segments, *out, None)

    return write, read


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the compiled kernels run: see the gpu test below")
def test_families_hold_every_kernel_the_cache_launches():
    families = qvg_families()
    write, read = qvg_calls("cpu")
    with backend("triton"):
        with counting_launches() as written:
            write()
        with counting_launches() as read_names:
            read()
    assert written and set(written) <= families["qvg encoder"]
    assert read_names and set(read_names) <= families["qvg window read"]
    assert not families["qvg encoder"] & families["qvg window read"]
    assert device_events(write) == []  # no CUDA: nothing ran on a device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_profiler_names_the_kernels_the_cache_launches():
    write, read = qvg_calls("cuda")
    with backend("triton"):
        write()  # compiled first: the profiled calls only launch
        read()
        with counting_launches() as launched:
            events = device_events(write) + device_events(read)
    families = qvg_families()
    ours = [name for name, _ in events if any(name in names for names in families.values())]
    assert ours == launched  # each launch of ours, named as Triton names it, in order; torch's own ops are "other"
    sums = by_family(events, families)
    assert sums["qvg window read"]["launches"] == 1 and sums["qvg encoder"]["launches"] == len(launched) - 1
    assert all(us > 0 for _, us in events)
