"""The Triton encoder as a whole: bit-identical to the reference where k-means is not iterated, batches of
writes equal to one write after another in a fixed number of launches, the division-free ternary codes at
their rounding boundaries, the k-means precision levers, and the validation of batches."""

import copy

import pytest
import torch
from launch_counts import counting_launches, launch_arguments

import diffusers_qvg as dq
from diffusers_qvg.codecs.groups import scale_candidates
from diffusers_qvg.codecs.qvg import backend
from diffusers_qvg.codecs.qvg.kmeans import lloyd as reference_lloyd
from diffusers_qvg.codecs.qvg.triton.centroid_update import lloyd as triton_lloyd
from diffusers_qvg.codecs.qvg.triton.encoder import launch_count
from diffusers_qvg.codecs.status import WriteStatus
from diffusers_qvg.metrics import rel_l2

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled kernels on GPU, interpreted on CPU

# Without Lloyd iterations every step of the encoder is exact (strided or seeded init, rounding, assignment with
# exact products, residual codes), so the Triton path must reproduce the reference byte for byte.
EXACT_VARIANTS = {
    "default": dq.QVGConfig(num_centroids=4, kmeans_iters=0),
    "int4-fp16scales-bf16-2stages": dq.QVGConfig(
        bits=4, num_centroids=4, stages=2, centroid_dtype="bfloat16", scale_dtype="fp16", kmeans_iters=0
    ),
    "asym-int2-per-centroid-scales": dq.QVGConfig(
        symmetric=False, num_centroids=3, centroid_scale="centroid", group_size=16, kmeans_iters=0
    ),
    "asym-int4-fp16-no-stages": dq.QVGConfig(symmetric=False, bits=4, scale_dtype="fp16", stages=0, group_size=32),
    "official-random-init": dq.QVGConfig.official().with_(num_centroids=4, kmeans_iters=0),
    "three-stages-fp16-centroids": dq.QVGConfig(num_centroids=5, stages=3, centroid_dtype="float16", kmeans_iters=0),
    "fp32-centroids-absmax": dq.QVGConfig(
        num_centroids=6, centroid_dtype="float32", scale_search="absmax", group_size=8, kmeans_iters=0
    ),
}


def chunk(N=13, H=3, D=64, dtype=torch.bfloat16, seed=0, B=2):
    """Heads of very different magnitudes (the per-head shifts must follow them), each a scaled copy of a
    well-spread problem: no two centroids are equally near a point to within float32 rounding, so the
    assignment's accumulation order cannot matter."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, H, D, generator=g) + 0.5 * torch.randn(B, 1, H, D, generator=g)
    return (x * torch.logspace(-4, 3, H).view(1, 1, H, 1)).to(dtype).to(DEVICE)


def allocate(config, x, capacity=None, slots=1):
    B, N, H, D = x.shape
    return config.allocate(
        batch=B, capacity_tokens=capacity or N, heads=H, head_dim=D, num_slots=slots, dtype=x.dtype, device=DEVICE
    )


def assert_same_bytes(expected, actual):
    for name, t in expected.tensors().items():
        assert torch.equal(t.view(torch.uint8), getattr(actual, name).view(torch.uint8)), name


def encode(config, x, mode, **kwargs):
    storage = allocate(config, x)
    with backend(mode):
        config.quantize_into(storage, x, token_start=0, slot=0, **kwargs)
    return storage


@pytest.mark.parametrize("name", EXACT_VARIANTS)
def test_without_lloyd_iterations_the_triton_encoder_is_the_reference_byte_for_byte(name):
    config = EXACT_VARIANTS[name]
    x = chunk(N=17, D=64 if config.group_size != 8 else 48)
    assert_same_bytes(encode(config, x, "torch"), encode(config, x, "triton"))


def test_float16_and_float32_inputs_and_a_warm_start_are_exact_too():
    config = EXACT_VARIANTS["default"]
    for dtype in (torch.float16, torch.float32):
        x = chunk(dtype=dtype)
        assert_same_bytes(encode(config, x, "torch"), encode(config, x, "triton"))
    first = encode(config.with_(kmeans_iters=1), chunk(seed=1), "torch")
    x = chunk(seed=2)
    expected = encode(config, x, "torch", warm_start=first)
    assert_same_bytes(expected, encode(config, x, "triton", warm_start=first))


def test_lloyd_iterations_keep_the_reference_quality():
    config = dq.QVGConfig(num_centroids=6, kmeans_iters=2, stages=2)
    x = chunk(N=24, H=2)
    ours, theirs = encode(config, x, "triton"), encode(config, x, "torch")
    with backend("torch"):
        errors = [rel_l2(dq.dequantize(p), x) for p in (ours, theirs)]
    assert errors[0] <= errors[1] * 1.05 + 1e-6


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_precision_levers_match_the_reference_lloyd(precision):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 120, 32, generator=g).to(DEVICE)
    init = x[:, :10].clone()
    expected = reference_lloyd(x, init, 3, precision)
    torch.testing.assert_close(triton_lloyd(x, init, 3, precision), expected, rtol=0, atol=1e-5)
    if precision == "bf16":  # a different assignment, not the same one: on these points it moves some centroids
        assert not torch.allclose(expected, reference_lloyd(x, init, 3), rtol=0, atol=1e-7)


def test_the_precision_lever_is_a_validated_config_field():
    with pytest.raises(ValueError, match="kmeans_precision"):
        dq.QVGConfig(kmeans_precision="fp8")


# --- division-free ternary codes ------------------------------------------------------------------------------


def boundary_groups(search: str, fmt: torch.dtype) -> torch.Tensor:
    """One head of float32 residual groups of 64 whose extent is 1 (so shift = 2^-8 and candidate j's step is
    ``float(fmt(alpha_j * 256)) / 256``), filled with each candidate's ``step / 2`` and its float32 neighbours:
    the values where ``q = 0`` turns into ``q = +-1``."""
    steps = [(float(torch.tensor(a * 256.0).to(fmt).float()) / 256.0) for a in scale_candidates(search, torch.float64, "cpu").tolist()]
    values = []
    for step in steps:
        half = torch.tensor(step / 2, dtype=torch.float32)
        for v in (half, torch.nextafter(half, torch.tensor(0.0)), torch.nextafter(half, torch.tensor(1.0))):
            values += [float(v), -float(v)]
    groups = []
    for start in range(0, len(values), 62):
        body = values[start : start + 62]
        groups.append([1.0, -1.0] + body + [0.0] * (62 - len(body)))  # the extent, then the boundary values
    return torch.tensor(groups, dtype=torch.float32).reshape(1, -1, 1, 64)  # [B, tokens, H, D]: one group per token


@pytest.mark.parametrize("search", ["mse", "mse-coarse", "absmax"])
@pytest.mark.parametrize("scale_dtype", ["e4m3", "fp16"])
def test_ternary_codes_at_the_rounding_boundary_are_the_reference_bit_for_bit(search, scale_dtype):
    config = dq.QVGConfig(stages=0, scale_search=search, scale_dtype=scale_dtype)
    x = boundary_groups(search, config.scale_torch_dtype).to(DEVICE)
    expected, ours = encode(config, x, "torch"), encode(config, x, "triton")
    assert_same_bytes(expected, ours)
    if search == "absmax":  # one candidate, step 1: 0.5 is coded 0 (ties to even), its upper neighbour +-1
        with backend("torch"):
            decoded = dq.dequantize(ours)[0, 0, 0]
        assert decoded[2:8].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, -1.0]


# --- batches -------------------------------------------------------------------------------------------------


def launches_of(fn):
    """Names of the Triton kernels ``fn`` launches (interpreted or compiled)."""
    with counting_launches() as names:
        fn()
    return names


def test_a_batch_equals_its_writes_one_by_one():
    config = dq.QVGConfig(num_centroids=4, kmeans_iters=1)
    k, v = chunk(N=9, seed=4), chunk(N=9, seed=5)
    ours = [allocate(config, k, capacity=20, slots=3) for _ in range(2)]
    expected = copy.deepcopy(ours)
    with backend("triton"):
        config.quantize_into(expected[0], k, token_start=11, slot=2)
        config.quantize_into(expected[1], v, token_start=11, slot=2)
        config.quantize_into(expected[1], k, token_start=0, slot=0)
        config.quantize_batch_into([(ours[0], k, 11, 2), (ours[1], v, 11, 2), (ours[1], k, 0, 0)])
    for e, o in zip(expected, ours):
        assert_same_bytes(e, o)


@pytest.mark.parametrize("config", [dq.QVGConfig(num_centroids=4), dq.QVGConfig(num_centroids=4, stages=2, kmeans_iters=1), dq.QVGConfig.rtn()])
def test_a_batch_launches_a_fixed_number_of_kernels(config):
    x = chunk(N=5, H=1, B=1)
    counts = []
    for n in (1, 2, 3):
        storages = [allocate(config, x) for _ in range(n)]
        with backend("triton"):
            counts.append(len(launches_of(lambda: config.quantize_batch_into([(s, x, 0, 0) for s in storages]))))
    assert counts == [launch_count(config)] * 3
    assert launch_count(dq.QVGConfig()) == 14  # issue 8: at most 6 per layer, 3 layers per call


def test_launches_that_read_every_point_alternate_their_order_over_the_problems():
    """Each launch that reads all the points takes the problems in the reverse order of the one before (it
    starts on those the last one left in L2); the strided init and the rounding read a few rows, forwards."""
    x, config = chunk(N=9, H=2, B=1), dq.QVGConfig(num_centroids=4)
    storages = [allocate(config, x) for _ in range(2)]
    with backend("triton"), launch_arguments("reverse") as launches:
        config.quantize_batch_into([(s, x, 0, 0) for s in storages])
    assign, update = "_assign_kernel", "_centroid_update_kernel"
    assert launches == [(update, 0), *[(assign, 0), (update, 1)] * 5, ("_centroid_round_kernel", 0), (assign, 0),
                        ("_residual_codes_kernel", 1)]


@pytest.mark.parametrize("config", [dq.QVGConfig(num_centroids=4, kmeans_iters=2),
                                    dq.QVGConfig(bits=4, symmetric=False, num_centroids=3, stages=2, kmeans_iters=1)])
def test_the_order_over_the_problems_changes_no_byte(config, monkeypatch):
    """Every kernel stores the same bytes whichever order its programs take the problems in (several items,
    batch rows and heads: a program's problem is a bijection of the grid)."""
    from diffusers_qvg.codecs.qvg.triton.problems import Problems

    k, v = chunk(N=11, H=3, B=2, seed=6), chunk(N=11, H=3, B=2, seed=7)
    results = []
    for order in (None, 0, 1):  # alternating (shipped), all forwards, all backwards
        if order is not None:
            monkeypatch.setattr(Problems, "sweep", lambda self, order=order: order)
        storages = [allocate(config, k) for _ in range(2)]
        with backend("triton"):
            config.quantize_batch_into([(storages[0], k, 0, 0), (storages[1], v, 0, 0)])
        results.append(storages)
    for other in results[1:]:
        for expected, actual in zip(results[0], other):
            assert_same_bytes(expected, actual)


@pytest.mark.parametrize("value, message", [
    (float("inf"), "NaN or Inf values in V;"), (float("nan"), "NaN or Inf values in V;"),
    (-2.0**60, "values up to 1.15e\\+18 in V;"),  # the device-side check: NaN kept by its max, |x| signed
])  # fmt: skip
def test_a_checked_batch_stores_the_items_before_a_bad_one_and_refuses_the_rest(value, message):
    config = dq.QVGConfig(num_centroids=4, kmeans_iters=1)
    x = chunk(N=8, dtype=torch.float32, seed=6)
    bad = x.clone()
    bad[1, 2, 0, 5] = value
    storages = [allocate(config, x) for _ in range(3)]
    expected = allocate(config, x)
    status = WriteStatus(DEVICE)
    with backend("triton"):
        config.quantize_into(expected, x, token_start=0, slot=0)
        before = copy.deepcopy(storages)
        config.quantize_batch_into([(s, t, 0, 0) for s, t in zip(storages, (x, bad, x))], status=status, whats=["K", "V", "K2"])
    assert_same_bytes(expected, storages[0])
    for s, b in zip(storages[1:], before[1:]):
        assert_same_bytes(b, s)
    with pytest.raises(ValueError, match=message):
        status.raise_if_failed()


def test_an_unchecked_batch_raises_at_the_bad_item_after_writing_the_ones_before():
    config = dq.QVGConfig(num_centroids=4, kmeans_iters=0)
    x = chunk(N=8, dtype=torch.float32, seed=7)
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    storages = [allocate(config, x) for _ in range(3)]
    before = copy.deepcopy(storages)
    with backend("triton"), pytest.raises(ValueError, match="item 1 contains NaN or Inf"):
        config.quantize_batch_into([(s, t, 0, 0) for s, t in zip(storages, (x, bad, x))])
    assert (storages[0].scale_shift > 0).all()
    for s, b in zip(storages[1:], before[1:]):
        assert_same_bytes(b, s)


def test_codecs_without_batched_kernels_batch_by_looping():
    x = chunk(N=16, dtype=torch.float32)
    for config, roles in ((dq.BF16Config(), ["key", "value"]), (dq.KIVIConfig(key_group_tokens=8), ["key", "value"])):
        ours = [config.allocate(batch=2, capacity_tokens=16, heads=3, head_dim=64, num_slots=1, dtype=x.dtype,
                                device=DEVICE, role=r) for r in roles]  # fmt: skip
        expected = copy.deepcopy(ours)
        for s, r in zip(expected, roles):
            config.quantize_into(s, x, token_start=0, slot=0, role=r)
        config.quantize_batch_into([(s, x, 0, 0) for s in ours], roles=roles)
        for e, o in zip(expected, ours):
            assert_same_bytes(e, o)


BAD_BATCHES = {
    "no items": (lambda s, t, x, y: [], {}, "no items"),
    "not a tuple": (lambda s, t, x, y: [[s, x, 0, 0]], {}, r"items\[0\] must be a \(storage, x, token_start, slot\)"),
    "overlapping tokens": (lambda s, t, x, y: [(s, x, 0, 0), (s, x, 4, 1)], {}, "items 0 and 1 write the same storage"),
    "one slot twice": (lambda s, t, x, y: [(s, x, 0, 0), (s, x, 16, 0)], {}, "items 0 and 1 write the same storage"),
    "two shapes": (lambda s, t, x, y: [(s, x, 0, 0), (t, y, 0, 0)], {}, "share one shape"),
    "whats per item": (lambda s, t, x, y: [(s, x, 0, 0)], dict(whats=["a", "b"]), "whats has 2 entries for 1 items"),
    "capacity beyond the storage": (lambda s, t, x, y: [(s, x, 0, 0), (t, x, 28, 0)], {}, r"do not fit the storage"),
}


@pytest.mark.parametrize("name", BAD_BATCHES)
def test_bad_batches_raise_before_anything_is_written(name):
    config = dq.QVGConfig(num_centroids=4, kmeans_iters=0)
    x, y = chunk(N=8), chunk(N=6)
    s, t = allocate(config, x, capacity=32, slots=2), allocate(config, x, capacity=32, slots=2)
    before = copy.deepcopy((s, t))
    items, kwargs, message = BAD_BATCHES[name]
    with backend("triton"), pytest.raises((ValueError, TypeError), match=message):
        config.quantize_batch_into(items(s, t, x, y), **kwargs)
    assert_same_bytes(before[0], s) and assert_same_bytes(before[1], t)


def test_storages_of_different_layouts_cannot_share_a_batch():
    config = dq.QVGConfig(num_centroids=4, kmeans_iters=0)
    x = chunk(N=8)
    s, t = allocate(config, x, capacity=16), allocate(config, x, capacity=24)
    with backend("triton"), pytest.raises(ValueError, match="allocated alike"):
        config.quantize_batch_into([(s, x, 0, 0), (t, x, 0, 0)])
    assert (s.scale_shift == 0).all() and (t.scale_shift == 0).all()


def test_segments_too_long_for_int32_offsets_are_refused():
    from diffusers_qvg.codecs.qvg.triton.problems import points_problems

    x = torch.empty(2**31 + 8, device="meta").as_strided((1, 2, 4), (0, 2**31, 1))  # no memory behind it
    with pytest.raises(ValueError, match="fewer than 2\\^31"):
        points_problems(x, 1)


def test_segments_too_long_for_the_strided_init_are_refused():
    from diffusers_qvg.codecs.qvg.triton.problems import points_problems

    x = torch.empty(1, 2**16 + 1, 1, device="meta")  # (K - 1) N = 2^32 + 2^16
    with pytest.raises(ValueError, match="< 2\\^32"):
        points_problems(x, 2**16 + 1)
    points_problems(x[:, : 2**16 - 1], 2**16 + 1)  # (K - 1) N < 2^32: accepted


def test_segments_too_long_for_the_update_members_are_refused():
    """The centroid update packs a member's token and its place among 32 centroids into one int32."""
    from diffusers_qvg.codecs.qvg.triton.problems import MAX_TOKENS, points_problems

    x = torch.empty(1, MAX_TOKENS, 1, device="meta")
    with pytest.raises(ValueError, match=f"{MAX_TOKENS} tokens is too long"):
        points_problems(x, 2)
    points_problems(x[:, : MAX_TOKENS - 1], 2)  # accepted


def test_problem_sets_too_wide_for_the_launch_grid_are_refused():
    """The kernels' grid holds the items x batch rows on its third axis, which CUDA caps at 65,535."""
    from diffusers_qvg.codecs.qvg.triton.problems import GRID_AXIS, points_problems

    x = torch.empty(GRID_AXIS + 1, 4, 8, device="meta")  # P problems are P batch rows of one item
    with pytest.raises(ValueError, match=f"{GRID_AXIS + 1} rows.*at most {GRID_AXIS}"):
        points_problems(x, 2)
    points_problems(x[:GRID_AXIS], 2)  # accepted
