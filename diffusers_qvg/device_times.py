"""Device time per kernel of a call, from the PyTorch profiler: where the benchmarks' milliseconds go on a GPU.

The benchmarks time calls with CUDA events; this module says which kernels those milliseconds are, so that a GPU
run also checks the static sm_90 estimates launch by launch (docs/benchmarks.md) and splits a chunk's overhead
into the window read, the encoder and the rest. On a machine without CUDA nothing runs on a device: every call
returns no events, and the benchmarks say so in their rows.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable

import torch

Event = tuple[str, float]  # (kernel name, device microseconds), in launch order


def device_events(fn: Callable[[], object]) -> list[Event]:
    """The device activities (kernels, copies, fills) of one call of ``fn``, in start order; [] without CUDA."""
    if not torch.cuda.is_available():
        fn()
        return []
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA]
    return [(e.name(), e.duration_ns() / 1e3) for e in sorted(events, key=lambda e: e.start_ns())]


def launch_medians(runs: list[list[Event]]) -> list[Event]:
    """Each launch's median time over repeated runs of one call (the same launches in the same order)."""
    if not runs:
        return []
    names = [name for name, _ in runs[0]]
    for run in runs[1:]:
        if [name for name, _ in run] != names:
            raise ValueError(f"the runs launched different kernels: {names} and {[name for name, _ in run]}")
    return [(name, statistics.median(run[i][1] for run in runs)) for i, name in enumerate(names)]


def qvg_families() -> dict[str, frozenset[str]]:
    """The package's Triton kernels by family: the window read (the decoder module's kernels) and the encoder
    (every other kernel module's), read from the modules (their ``*_kernel`` JIT functions, interpreted ones
    too) so that no name list goes stale."""
    import triton

    from diffusers_qvg.codecs.qvg.triton import assign, centroid_round, centroid_update, dequantize, quantize

    def kernels(*modules) -> frozenset[str]:
        return frozenset(n for m in modules for n, v in vars(m).items()
                         if isinstance(v, triton.runtime.KernelInterface) and n.endswith("_kernel"))

    return {"qvg window read": kernels(dequantize),
            "qvg encoder": kernels(assign, centroid_round, centroid_update, quantize)}


def by_family(events: Iterable[Event], families: dict[str, frozenset[str]]) -> dict[str, dict[str, float]]:
    """Microseconds and launches per family (a kernel whose name is one of the family's); "other" for the rest
    (the model's GEMMs, attention, copies), and "total"."""
    sums = {name: dict(us=0.0, launches=0) for name in (*families, "other", "total")}
    for name, us in events:
        family = next((f for f, names in families.items() if name in names), "other")
        for key in (family, "total"):
            sums[key]["us"] += us
            sums[key]["launches"] += 1
    return sums
