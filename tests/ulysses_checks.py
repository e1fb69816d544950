"""The checks of tests/test_ulysses.py, run on every rank of a ``torchrun`` launch (CPU, gloo).

``python -m torch.distributed.run --standalone --nproc-per-node N tests/ulysses_checks.py OUT`` runs the checks
of world size N and writes ``OUT/rank{r}.json``: ``{check: "ok" or the error}``. Each rank also runs the
single-process reference itself (a transformer without context parallelism), so "equal" means bitwise equal
to one process. diffusers 0.42's ``enable_parallelism`` divides by ``torch.accelerator.device_count()``, which
is 0 on a CPU build: the worker patches it to 1 (the only shim; everything else is the real path).
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig, WanTransformer3DModel

import diffusers_qvg as dq

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script by torchrun
from wan_helpers import build  # noqa: E402

TEXT_DIM = 32
QVG_SMALL = dq.QVGConfig(num_centroids=4, group_size=4)


@dataclass(frozen=True)
class Setup:
    """One video: the cache's settings and the stream's geometry (latent pixels ``hw`` x ``hw``, 2x2 patches)."""

    storage: object = "bf16"
    commit: str = "on-advance"
    window_frames: int | None = 6
    sink_frames: int = 2
    keep_recent_chunks: int = 1
    heads: int = 4
    head_dim: int = 12
    hw: int = 8  # 32 tokens per chunk: stock Ulysses itself is not bitwise with 2 tokens per rank (CPU matmuls)
    frames: int = 2
    chunks: int = 5
    batch: int = 1
    steps: tuple[float, ...] = (900.0, 500.0)
    keys_before_rope: bool = True  # False with bf16 storage: the in-place window (CacheConfig.in_place)

    def cache_options(self) -> dict:
        return dict(window_frames=self.window_frames, sink_frames=self.sink_frames, commit=self.commit,
                    keep_recent_chunks=self.keep_recent_chunks, keys_before_rope=self.keys_before_rope)


# The pipeline's setting for qvg-int2 (256 centroids, groups of 64 channels): 256 tokens per chunk.
QVG_INT2 = Setup(storage="qvg-int2", head_dim=64, hw=32, frames=1, chunks=4, window_frames=3, sink_frames=1,
                 keep_recent_chunks=0)


def wan(setup: Setup, seed: int = 0) -> WanTransformer3DModel:
    return build(WanTransformer3DModel, torch.float64, seed, num_attention_heads=setup.heads,
                 attention_head_dim=setup.head_dim)


def inputs(setup: Setup):
    """Every forward's (start frame, final, latents, timestep): the same on every rank."""
    g = torch.Generator().manual_seed(0)
    for c in range(setup.chunks):
        for t in (*setup.steps, 0.0):
            x = torch.randn(setup.batch, 16, setup.frames, setup.hw, setup.hw, dtype=torch.float64, generator=g)
            yield setup.frames * c, t == 0.0, x, torch.full((setup.batch,), t, dtype=torch.float64)


TEXT = torch.randn(1, 8, TEXT_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def forward(model, cache, start, final, x, t):
    with cache.chunk(start_frame=start, final=final, hidden_states=x):
        return model(x, t, TEXT.expand(x.shape[0], -1, -1), return_dict=False)[0]


def stream(model, cache, setup: Setup) -> list[torch.Tensor]:
    return [forward(model, cache, *step) for step in inputs(setup)]


def ulysses(model) -> None:
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=dist.get_world_size()))


def install(setup: Setup, order: str):
    """A transformer with the cache and Ulysses over the world, installed in ``order``."""
    model = wan(setup)
    if order == "cp-first":
        ulysses(model)
    cache = dq.enable_qvg(model, setup.storage, **setup.cache_options())
    if order == "qvg-first":
        ulysses(model)
    return model, cache


_REFERENCES: dict[Setup, tuple] = {}


def reference(setup: Setup):
    """The single-process run of ``setup`` (outputs and cache), once per worker."""
    if setup not in _REFERENCES:
        model = wan(setup)
        cache = dq.enable_qvg(model, setup.storage, **setup.cache_options())
        _REFERENCES[setup] = (stream(model, cache, setup), cache)
    return _REFERENCES[setup]


HEAD_AXIS = {"centroids": 3, "centroid_scales": 3}  # every other storage tensor holds heads on dim 2


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # bytes: float8 tensors have no equality on the CPU


def assert_head_shard_of(cache, expected_cache) -> None:
    """Every stored tensor of this rank is the single-process tensor narrowed to the rank's heads, and
    the rank holds exactly 1/N of the bytes."""
    shard = cache.shard
    assert shard is not None and shard.world == dist.get_world_size()
    start = shard.rank * shard.heads
    for layer, expected in zip(cache.layers, expected_cache.layers, strict=True):
        mine, theirs = layer.storages(), expected.storages()
        assert [type(s) for s in mine] == [type(s) for s in theirs]
        for s, e in zip(mine, theirs):
            for name, tensor in s.tensors().items():
                part = e.tensors()[name].narrow(HEAD_AXIS.get(name, 2), start, shard.heads)
                assert torch.equal(raw(tensor), raw(part)), f"layer {layer.index} {type(s).__name__}.{name}"
            assert s.nbytes * shard.world == e.nbytes
    mine, total, single = cache.memory_report(), cache.memory_report(gathered=True), expected_cache.memory_report()
    assert mine.cache * shard.world == single.cache > 0 and mine.ranks == 1
    assert (total.cache, total.bf16_equivalent, total.cached_tokens, total.ranks) == (
        single.cache, single.bf16_equivalent, single.cached_tokens, shard.world)


def assert_equal_outputs(outputs, expected) -> None:
    assert len(outputs) == len(expected)
    for i, (a, b) in enumerate(zip(outputs, expected)):
        assert torch.equal(a, b), f"forward {i}: max error {(a - b).abs().max().item():.3g}"


def check_equal(setup: Setup, order: str) -> None:
    expected, expected_cache = reference(setup)
    model, cache = install(setup, order)
    assert_equal_outputs(stream(model, cache, setup), expected)
    assert_head_shard_of(cache, expected_cache)


def expect_error(error: type, match: str, call) -> str:
    try:
        call()
    except error as e:
        assert match in str(e), f"{type(e).__name__}: {e}"
        return str(e)
    raise AssertionError(f"{call} did not raise {error.__name__}")


def check_refused(config: dict, order: str, error: type, match: str, heads: int = 4) -> None:
    """Refused at install (parallelism first) or at the first chunk (the cache first), on every rank."""
    setup = Setup(heads=heads)
    model = wan(setup)
    start, final, x, t = next(inputs(setup))
    if order == "cp-first":
        model.enable_parallelism(config=ContextParallelConfig(**config))
        stock = dict(model.attn_processors)
        expect_error(error, match, lambda: dq.enable_qvg(model, "bf16"))
        assert model.attn_processors == stock  # nothing was installed
        return
    cache = dq.enable_qvg(model, "bf16")
    model.enable_parallelism(config=ContextParallelConfig(**config))
    expect_error(error, match, lambda: forward(model, cache, start, final, x, t))
    expect_error(error, match, lambda: cache.chunk(start_frame=0).__enter__())  # no input given: the same
    assert cache.layout.chunks == [] and not cache.active


def check_disable(order: str) -> None:
    """``disable_qvg`` gives back stock processors that keep the parallel config, whichever came first:
    a forward outside the cache is stock Wan's under Ulysses, bitwise the single process's."""
    setup = Setup()
    expected = stock_forward(wan(setup))
    model, cache = install(setup, order)
    stream(model, cache, replace(setup, chunks=2))
    dq.disable_qvg(model)
    processors = model.attn_processors.values()
    assert all(type(p).__name__ == "WanAttnProcessor" and p._parallel_config is model._parallel_config for p in processors)
    assert torch.equal(stock_forward(model), expected)
    cache = dq.enable_qvg(model, "bf16", **setup.cache_options())  # and on again: the same video as one process
    assert_equal_outputs(stream(model, cache, setup), reference(setup)[0])


def stock_forward(model) -> torch.Tensor:
    _, _, x, t = next(inputs(Setup()))
    with torch.no_grad():
        return model(x, t, TEXT, return_dict=False)[0]


def check_shared_processor(order: str) -> None:
    """One processor for every layer (``set_attn_processor`` + ``attach_cache``), before or after Ulysses: the
    cached stream, a forward outside the cache (the processor set after ``enable_parallelism`` gets its config
    from ``attach_cache``) and ``disable_qvg`` all match one process."""
    setup = Setup(commit="final-pass")
    model = wan(setup)
    if order == "cp-first":
        ulysses(model)
    cache = dq.QVGCache(dq.CacheConfig(storage=setup.storage, **setup.cache_options()))
    model.set_attn_processor(dq.QVGWanAttnProcessor(cache))
    dq.attach_cache(model, cache)
    if order == "qvg-first":
        ulysses(model)
    assert_equal_outputs(stream(model, cache, setup), reference(setup)[0])
    assert_head_shard_of(cache, reference(setup)[1])
    expected = stock_forward(wan(setup))
    assert torch.equal(stock_forward(model), expected)
    dq.disable_qvg(model)
    assert torch.equal(stock_forward(model), expected)


def poison_keys(model, head: int, head_dim: int):
    """Inf in ``head``'s keys of layer 0 for the tokens this process holds (after the all-to-all, heads of the
    last rank); returns the hook's handle."""
    def hook(module, args, out):
        out = out.clone()
        out[..., head * head_dim : (head + 1) * head_dim] = float("inf")
        return out

    return model.blocks[0].attn1.to_k.register_forward_hook(hook)


def refused_write(model, cache, setup: Setup, bad: int, poison: bool) -> tuple[list, int, str]:
    """Run the stream with ``poison_keys`` in forward ``bad``, until a write is refused: the outputs before,
    the index of the refused forward and its message."""
    outputs = []
    for i, step in enumerate(inputs(setup)):
        handle = poison_keys(model, setup.heads - 1, setup.head_dim) if poison and i == bad else None
        try:
            outputs.append(forward(model, cache, *step))
        except ValueError as error:
            return outputs, i, str(error)
        finally:
            if handle is not None:
                handle.remove()
    raise AssertionError("no write was refused")


def check_bad_write(commit: str) -> None:
    """Inf in layer 0's keys of the last rank's heads, from rank 0's tokens only. Every rank refuses the same
    write with the single process's message (naming the rank) and none hangs; with ``final-pass`` the refused
    clean-context pass left the cache as it was, so the pass again and the rest of the stream give the single
    process's video. (With ``on-advance`` the chunk sits unchecked in its slot until the next chunk packs it,
    and that advance is refused.)"""
    world, rank = dist.get_world_size(), dist.get_rank()
    setup = Setup(commit=commit, chunks=3, window_frames=None, sink_frames=0, keep_recent_chunks=0)
    per_chunk = len(setup.steps) + 1
    bad = 2 * per_chunk - 1  # the clean-context pass (the last forward) of chunk 1
    single = wan(setup)
    _, single_at, single_message = refused_write(single, dq.enable_qvg(single, setup.storage, **setup.cache_options()),
                                                 setup, bad, poison=True)
    model, cache = install(setup, "qvg-first")
    outputs, at, message = refused_write(model, cache, setup, bad, poison=rank == 0)
    assert at == single_at == (bad if commit == "final-pass" else bad + 1)
    assert "nothing was cached" in message
    assert message == single_message.replace("layer 0's keys", f"layer 0's keys (the heads of rank {world - 1} of {world})")
    if commit == "final-pass":
        outputs += [forward(model, cache, *step) for step in list(inputs(setup))[bad:]]
        assert_equal_outputs(outputs, reference(setup)[0])
        assert_head_shard_of(cache, reference(setup)[1])


def check_indivisible_tokens() -> None:
    """A chunk of 9 tokens cannot be split across the ranks: refused on every rank before anything changes,
    and the same cache then runs a valid stream as one process does."""
    setup = Setup()
    model, cache = install(setup, "qvg-first")
    x = torch.randn(1, 16, 1, 6, 6, dtype=torch.float64)
    expect_error(ValueError, "not divisible by ulysses_degree", lambda: forward(model, cache, 0, False, x, x.new_ones(1)))
    assert cache.layout.chunks == [] and cache.geometry is None
    assert_equal_outputs(stream(model, cache, setup), reference(setup)[0])


def check_pipeline_two_videos() -> None:
    """World 4, ``enable_ulysses(transformer, 2)``: two groups of two ranks, each making its own prompt's video,
    bitwise the single process's latents (float32, qvg-int2)."""
    from diffusers_qvg.pipelines import QVGCausalWanPipeline, tiny_components

    def pipeline():
        pipe = QVGCausalWanPipeline(**tiny_components(seed=0))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    prompts = ["a red boat", "a blue car"]
    options = dict(height=160, width=160, num_frames=21, output_type="latent", window_frames=4)
    pipe = pipeline()
    group = dq.enable_ulysses(pipe.transformer, 2)
    rank = dist.get_rank()
    assert (group.index, group.count, group.rank, group.degree) == (rank // 2, 2, rank % 2, 2)
    expected = pipeline()(prompts[group.index], **options).frames
    assert torch.equal(pipe(prompts[group.index], **options).frames, expected)


def check_cli_two_videos(out: Path) -> None:
    """``qvg-generate --prompts-file ... --ulysses 2`` on 4 processes: two videos at a time, each written once,
    by its group's first rank."""
    import imageio.v2 as imageio

    from diffusers_qvg.cli import main

    prompts, videos = out / "prompts.txt", out / "videos"
    if dist.get_rank() == 0:
        prompts.write_text("a red boat\na blue car\n")
    dist.barrier()
    main(["--prompts-file", str(prompts), "--ulysses", "2", "--num-frames", "9", "--height", "32", "--width", "32",
          "--kv-cache", "bf16", "--output", str(videos)])
    dist.barrier()
    assert sorted(p.name for p in videos.iterdir()) == ["0000-rank0-a-red-boat.mp4", "0001-rank2-a-blue-car.mp4"]
    with imageio.get_reader(videos / "0001-rank2-a-blue-car.mp4", "ffmpeg") as reader:
        assert len([frame for frame in reader]) == 9


def check_bench_e2e() -> None:
    """``scripts/bench_e2e.py --ulysses 2`` runs its settings under Ulysses (the multi-GPU run needs no new code)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_e2e", Path(__file__).resolve().parents[1] / "scripts" / "bench_e2e.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--small", "--ulysses", "2", "--storages", "bf16", "qvg-int2", "--keep-recent-chunks", "0"])
    assert [(r["storage"], r["error"], r["ulysses"]) for r in rows] == [("bf16", None, 2)] * 2 + [("qvg-int2", None, 2)]


RING = dict(ring_degree=2)
ANYTHING = dict(ulysses_degree=2, ulysses_anything=True)
ULYSSES_2 = dict(ulysses_degree=2)
UNIFIED = dict(ring_degree=2, ulysses_degree=2)
ORDERS = ("qvg-first", "cp-first")
FINAL = Setup(commit="final-pass", batch=2)  # CFG as batch 2
QVG_FINAL = replace(QVG_INT2, commit="final-pass")


def checks(world: int, out: Path) -> dict:
    """The checks of a launch with ``world`` ranks, by name."""
    if world == 2:
        found = {f"equal-{name}-{order}": (lambda s=setup, o=order: check_equal(s, o))
                 for name, setup in (("bf16-on-advance", Setup()), ("bf16-final-pass-cfg", FINAL),
                                     ("qvg-int2-on-advance", QVG_INT2), ("qvg-int2-final-pass", QVG_FINAL),
                                     ("bf16-in-place", Setup(commit="final-pass", keys_before_rope=False)))
                 for order in ORDERS}
        for init in ("random", "kmeans++"):
            setup = Setup(storage=QVG_SMALL.with_(kmeans_init=init), commit="final-pass", keep_recent_chunks=0)
            found[f"equal-qvg-{init}-init"] = lambda s=setup: check_equal(s, "qvg-first")
        for order in ORDERS:
            found[f"refused-ring-{order}"] = lambda o=order: check_refused(RING, o, NotImplementedError, "ring context")
            found[f"refused-ulysses-anything-{order}"] = lambda o=order: check_refused(
                ANYTHING, o, NotImplementedError, "ulysses_anything=True")
            found[f"refused-heads-{order}"] = lambda o=order: check_refused(
                ULYSSES_2, o, ValueError, "3 attention heads, not divisible by ulysses_degree=2", heads=3)
            found[f"disable-{order}"] = lambda o=order: check_disable(o)
            found[f"shared-processor-{order}"] = lambda o=order: check_shared_processor(o)
        found["refused-indivisible-tokens"] = check_indivisible_tokens
        found["bad-write-final-pass"] = lambda: check_bad_write("final-pass")
        found["bad-write-on-advance"] = lambda: check_bad_write("on-advance")
        found["bench-e2e"] = check_bench_e2e
        return found
    return {
        "equal-bf16-on-advance-qvg-first": lambda: check_equal(Setup(), "qvg-first"),
        "equal-bf16-final-pass-cfg-cp-first": lambda: check_equal(FINAL, "cp-first"),
        "equal-qvg-int2-final-pass-qvg-first": lambda: check_equal(QVG_FINAL, "qvg-first"),
        "equal-qvg-int2-on-advance-cp-first": lambda: check_equal(QVG_INT2, "cp-first"),
        **{f"refused-unified-{order}": (lambda o=order: check_refused(UNIFIED, o, NotImplementedError, "ring x Ulysses"))
           for order in ORDERS},
        "bad-write-final-pass": lambda: check_bad_write("final-pass"),
        "pipeline-two-videos": check_pipeline_two_videos,
        "cli-two-videos": lambda: check_cli_two_videos(out),
    }


def main() -> None:
    from diffusers.utils import logging

    out = Path(sys.argv[1])
    torch.accelerator.device_count = lambda: 1  # diffusers 0.42 divides by it; 0 on a CPU build
    logging.set_verbosity_error()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a hung collective fails its check
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for name, check in checks(world, out).items():
        try:
            check()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=-6)
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
