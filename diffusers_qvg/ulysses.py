"""One video on N ranks: diffusers' Ulysses context parallelism over a (videos, ring, ulysses) device mesh.

With world size M and ``degree`` N, the M ranks form M/N groups of N consecutive ranks; each group
generates one video at a time (its ranks run the same prompt, seed and chunks; diffusers splits every
chunk's tokens across them, and each rank's cache holds H/N heads), and the groups take different prompts.
This is ``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N, mesh=...))`` with a
mesh whose extra leading dimension numbers the groups; nothing else changes (``enable_qvg`` may come before
or after).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig
from torch.distributed.device_mesh import init_device_mesh


@dataclass(frozen=True)
class VideoGroup:
    """This rank's place: group ``index`` of ``count`` (which share of the prompts it generates), rank
    ``rank`` of the group's ``degree`` (rank 0 writes the group's outputs)."""

    index: int
    count: int
    rank: int
    degree: int


def enable_ulysses(transformer: torch.nn.Module, degree: int) -> VideoGroup:
    """Run ``transformer`` with Ulysses context parallelism over groups of ``degree`` ranks; needs
    ``torch.distributed`` initialised (``torchrun`` / ``accelerate launch``) on a world size divisible by
    ``degree``. Returns this rank's :class:`VideoGroup`."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "Ulysses needs torch.distributed initialised: launch with `torchrun --nproc-per-node M` or "
            "`accelerate launch --num_processes M`"
        )
    world = dist.get_world_size()
    if not isinstance(degree, int) or degree < 2 or world % degree:
        raise ValueError(f"ulysses degree {degree!r} must be a divisor of the world size {world}, at least 2")
    if torch.accelerator.device_count() < 1:
        raise RuntimeError(
            "diffusers 0.42's enable_parallelism places rank r on accelerator r % torch.accelerator.device_count(), "
            "which is 0 on this machine; Ulysses needs GPUs (the CPU tests patch device_count to return 1)"
        )
    device_type = next(transformer.parameters()).device.type
    mesh = init_device_mesh(device_type, (world // degree, 1, degree), mesh_dim_names=("videos", "ring", "ulysses"))
    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree, mesh=mesh))
    return VideoGroup(
        index=mesh["videos"].get_local_rank(),
        count=world // degree,
        rank=mesh["ulysses"].get_local_rank(),
        degree=degree,
    )
