"""``torch.compile(transformer, fullgraph=True)`` over the cached transformer, on the CPU.

The chunk is planned when its block starts (``cache.chunk(..., hidden_states=x)``), and a layer's reads and
writes are opaque ops (``diffusers_qvg/cache/ops.py``), so one graph covers the whole forward. The backend is
``aot_eager`` (Dynamo and AOTAutograd's functionalization, the parts that see our code; bit-identical to eager)
and, once, ``inductor`` (float32 rounding). A stream of 3-frame chunks with a 9-frame window and a 3-frame
sink fills the window at chunk 2 and slides from chunk 3 on: only the first two chunks may compile (a
denoising and a clean-pass graph each, then the same two with the window length dynamic).
"""

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from wan_helpers import HEIGHT, WIDTH, tiny_wan

import diffusers_qvg as dq
from diffusers_qvg.codecs.kernel_backend import backend

FRAMES = 3
TEXT = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
STORAGES = {
    "bf16": "bf16",
    "qvg-int2": dq.QVGConfig(num_centroids=4, group_size=4),
    "qvg-int4": dq.QVGConfig(bits=4, num_centroids=4, group_size=4),
    "kivi-int2": dq.KIVIConfig(group_size=4, key_group_tokens=4),
}
WINDOW = dict(window_frames=9, sink_frames=3)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Compiled code is cached per code object across models: each test starts from none."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def forwards(chunks: int, seed: int = 0):
    """Two denoising forwards and the clean-context pass of each chunk: (start, final, latents, timestep)."""
    g = torch.Generator().manual_seed(seed)
    for c in range(chunks):
        for t in (500.0, 250.0, 0.0):
            yield FRAMES * c, t == 0.0, torch.randn(1, 16, FRAMES, HEIGHT, WIDTH, generator=g), t


def step(model, cache, start, final, x, t):
    with cache.chunk(start_frame=start, final=final, hidden_states=x):
        return model(hidden_states=x, timestep=torch.tensor([t]), encoder_hidden_states=TEXT, return_dict=False)[0]


def compiled_pair(storage, backend_name="aot_eager", **options):
    """An eager and a compiled copy of one tiny Wan (float32), each with its own cache."""
    eager, compiled = tiny_wan(torch.float32), tiny_wan(torch.float32)
    counter = CompileCounterWithBackend(backend_name)
    compiled.compile(backend=counter, fullgraph=True)
    caches = [dq.enable_qvg(m, storage, **options) for m in (eager, compiled)]
    return (eager, compiled), caches, counter


def stored_bytes(cache):
    return [t.view(torch.uint8) for layer in cache.layers for s in layer.storages() for t in s.tensors().values()]


def run_stream(models, caches, counter, chunks, compare):
    """Every forward through both models; the compile count after each chunk."""
    counts = []
    for start, final, x, t in forwards(chunks):
        outs = [step(m, c, start, final, x, t) for m, c in zip(models, caches)]
        compare(outs[1], outs[0])
        if final:
            counts.append(counter.frame_count)
    return counts


@torch.no_grad()
@pytest.mark.parametrize(
    "name, keep_recent_chunks, rotated",
    # 1: recent BF16 ring reads; rotated: BF16 with keys stored after RoPE attends to its storage in place
    [(name, 0, False) for name in STORAGES] + [("qvg-int2", 1, False), ("bf16", 0, True)],
)
def test_a_compiled_stream_equals_eager_and_stops_compiling_after_two_chunks(name, keep_recent_chunks, rotated):
    models, caches, counter = compiled_pair(
        STORAGES[name], commit="final-pass", keep_recent_chunks=keep_recent_chunks, keys_before_rope=not rotated,
        **WINDOW,
    )
    assert caches[0].config.in_place == rotated
    counts = run_stream(models, caches, counter, 6, lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0))
    assert counts[1] == counts[-1] <= 4, counts
    assert [(c.start_frame, c.place) for c in caches[1].layout.chunks] == [
        (c.start_frame, c.place) for c in caches[0].layout.chunks
    ]
    assert all(torch.equal(a, b) for a, b in zip(stored_bytes(caches[0]), stored_bytes(caches[1])))


@torch.no_grad()
def test_on_advance_compiles_too():
    """Every forward writes its chunk into a ring slot that alternates: still no recompiles."""
    models, caches, counter = compiled_pair("bf16", commit="on-advance", **WINDOW)
    counts = run_stream(models, caches, counter, 6, lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0))
    assert counts[1] == counts[-1] <= 4, counts


@torch.no_grad()
def test_a_second_video_after_reset_compiles_nothing():
    models, caches, counter = compiled_pair("bf16", commit="final-pass", **WINDOW)
    exact = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0)  # noqa: E731
    first = run_stream(models, caches, counter, 4, exact)
    for cache in caches:
        cache.reset()
    assert run_stream(models, caches, counter, 4, exact) == [first[-1]] * 4


@torch.no_grad()
def test_inductor_matches_eager_within_float32_rounding():
    models, caches, counter = compiled_pair(STORAGES["qvg-int2"], "inductor", commit="final-pass", **WINDOW)
    counts = run_stream(models, caches, counter, 4, lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5))
    assert counts[1] == counts[-1] <= 4, counts


@torch.no_grad()
def test_the_triton_kernels_run_inside_a_compiled_forward():
    """The custom ops run whatever backend the context chose: here the Triton kernels in the interpreter."""
    models, caches, counter = compiled_pair(STORAGES["qvg-int2"], commit="final-pass", window_frames=6)
    with backend("triton"):
        counts = run_stream(models, caches, counter, 3, lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0))
    assert counts[1] == counts[-1] <= 4, counts


# ----------------------------------------------------------------------------------------- errors
def snapshot(cache):
    return copy.deepcopy(cache.layout), [t.clone() for t in stored_bytes(cache)]


def assert_unchanged(cache, before):
    layout, tensors = snapshot(cache)
    assert layout == before[0] and len(tensors) == len(before[1])
    assert all(torch.equal(a, b) for a, b in zip(tensors, before[1]))


@torch.no_grad()
@pytest.mark.parametrize("name", ["bf16", "qvg-int2"])
def test_a_bad_clean_pass_raises_at_the_block_end_and_changes_nothing(name):
    models, caches, counter = compiled_pair(STORAGES[name], commit="final-pass", **WINDOW)
    exact = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0)  # noqa: E731
    run_stream(models, caches, counter, 3, exact)
    compiled, cache = models[1], caches[1]
    x = torch.randn(1, 16, FRAMES, HEIGHT, WIDTH)
    step(compiled, cache, 9, False, x, 500.0)
    before = snapshot(cache)
    bad = x.clone()
    bad[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf values in layer 0's keys.*nothing was cached"):
        step(compiled, cache, 9, True, bad, 0.0)
    assert_unchanged(cache, before)
    assert not cache.active and cache.interrupted is None
    step(models[0], caches[0], 9, False, x, 500.0)
    exact(step(compiled, cache, 9, True, x, 0.0), step(models[0], caches[0], 9, True, x, 0.0))


@torch.no_grad()
def test_a_compiled_forward_needs_its_chunk_planned_before_it():
    models, caches, _ = compiled_pair("bf16", commit="final-pass")
    x = torch.randn(1, 16, FRAMES, HEIGHT, WIDTH)
    with pytest.raises(Exception, match=r"cache\.chunk\(start_frame=f, hidden_states=x\)"):
        with caches[1].chunk(start_frame=0):
            models[1](hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=TEXT)
    assert caches[1].layout.chunks == [] and not caches[1].active


@torch.no_grad()
def test_a_forward_unlike_its_planned_chunk_is_refused_before_anything_changes():
    models, caches, counter = compiled_pair("bf16", commit="final-pass", **WINDOW)
    run_stream(models, caches, counter, 2, lambda a, b: None)
    before = snapshot(caches[1])
    planned, other = (torch.randn(1, 16, f, HEIGHT, WIDTH) for f in (FRAMES, FRAMES - 1))
    with pytest.raises(Exception, match="size|shape|tokens"):
        with caches[1].chunk(start_frame=6, final=True, hidden_states=planned):
            models[1](hidden_states=other, timestep=torch.tensor([0.0]), encoder_hidden_states=TEXT)
    assert_unchanged(caches[1], before)


def test_the_cache_ops_are_opaque_to_the_compiler_and_split_cuda_graphs():
    """Both ops read the live plan at run time: inductor must not capture them in a CUDA graph
    (``mode="reduce-overhead"`` splits its graphs around ops tagged ``cudagraph_unsafe``)."""
    for name in ("read_window", "store"):
        op = getattr(torch.ops.diffusers_qvg, name).default
        assert torch.Tag.cudagraph_unsafe in op.tags
    schema = str(torch.ops.diffusers_qvg.store.default._schema)
    assert "Tensor(a0!) status" in schema  # the store mutates the status, which keeps it alive and ordered
