"""The QVG reference codec: round trips, exact byte counts, error bounds, determinism, bad inputs, warm start."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import diffusers_qvg as dq
from diffusers_qvg.codecs.groups import dequantize_groups, pow2_at_least, quantize_groups
from diffusers_qvg.codecs.qvg.decode import decode_centroids, decode_tokens
from diffusers_qvg.codecs.qvg.encode import round_centroids
from diffusers_qvg.codecs.qvg.format import unpack_codes
from diffusers_qvg.codecs.qvg.kmeans import assign, kmeans_init, lloyd
from diffusers_qvg.codecs.qvg.residual import quantize_residual

B, N, H, D = 2, 48, 2, 16
SMALL = dict(group_size=8, num_centroids=4)


def clustered(b=B, n=N, h=H, d=D, clusters=4, noise=0.1, seed=0, dtype=torch.float32):
    """Tokens around a few centers per head: the structure k-means is for."""
    g = torch.Generator().manual_seed(seed)
    centers = 3 * torch.randn(b, clusters, h, d, generator=g)
    which = torch.randint(0, clusters, (b, n), generator=g)
    x = centers[torch.arange(b)[:, None], which] + noise * torch.randn(b, n, h, d, generator=g)
    return x.to(dtype)


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


VARIANTS = {
    "int2": dq.QVGConfig(**SMALL),
    "int4": dq.QVGConfig(bits=4, **SMALL),
    "int2-bits": dq.QVGConfig(packing="bits", **SMALL),
    "int2-asym": dq.QVGConfig(symmetric=False, **SMALL),
    "int4-asym": dq.QVGConfig(bits=4, symmetric=False, **SMALL),
    "fp16-scales": dq.QVGConfig(scale_dtype="fp16", **SMALL),
    "absmax": dq.QVGConfig(scale_search="absmax", **SMALL),
    "mse-coarse": dq.QVGConfig(scale_search="mse-coarse", **SMALL),
    "bf16-centroids": dq.QVGConfig(centroid_dtype="bfloat16", **SMALL),
    "fp16-centroids": dq.QVGConfig(centroid_dtype="float16", **SMALL),
    "fp32-centroids": dq.QVGConfig(centroid_dtype="float32", **SMALL),
    "e4m3-per-centroid": dq.QVGConfig(centroid_scale="centroid", **SMALL),
    "no-stages": dq.QVGConfig(stages=0, **SMALL),
    "two-stages": dq.QVGConfig(stages=2, **SMALL),
    "strided": dq.QVGConfig(kmeans_init="strided", **SMALL),
    "random": dq.QVGConfig(kmeans_init="random", **SMALL),
    "no-iters": dq.QVGConfig(kmeans_iters=0, **SMALL),
    "group-5": dq.QVGConfig(group_size=5, num_centroids=4),  # trits fill exactly one byte per 5 codes
    "official": dq.QVGConfig.official().with_(**SMALL),
    "rtn": dq.QVGConfig.rtn(group_size=8),
}


def storage_bytes(config, b, t, h, d, slots):
    """The byte count the layout table in format.py promises, computed independently."""
    G = d // config.group_size
    scale_bytes = 1 if config.scale_dtype == "e4m3" else 2
    per_token_head = G * config.group_code_bytes + G * scale_bytes * (1 if config.symmetric else 2)
    per_token_head += config.stages * (1 if config.centroids <= 256 else 2)
    centroid_bytes = {"e4m3": 1, "bfloat16": 2, "float16": 2, "float32": 4}[config.centroid_dtype]
    per_slot_head = config.stages * config.centroids * d * centroid_bytes + 4  # centroids + scale shift
    if config.centroid_dtype == "e4m3":
        per_slot_head += config.stages * 4 * (config.centroids if config.centroid_scale == "centroid" else 1)
    return b * t * h * per_token_head + slots * b * h * per_slot_head


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_round_trip_keeps_shape_dtype_and_counts_bytes(name, dtype):
    config = VARIANTS[name]
    d = 20 if config.group_size == 5 else D
    x = clustered(d=d, dtype=dtype)
    packed = dq.quantize(x, config)
    x_hat = dq.dequantize(packed)
    assert x_hat.shape == x.shape and x_hat.dtype == dtype
    assert torch.isfinite(x_hat).all()
    limit = 0.08 if config.bits == 4 else 0.6 if config.stages == 0 else 0.3
    assert rel_l2(x_hat, x) < limit
    assert packed.nbytes == sum(t.numel() * t.element_size() for t in packed.tensors().values())
    assert packed.nbytes == storage_bytes(config, B, N, H, d, 1)


def test_default_configs_meet_the_bit_budget_on_a_self_forcing_chunk():
    chunk = dict(batch=1, capacity_tokens=4680, heads=12, head_dim=128, num_slots=1, dtype=torch.bfloat16, device="cpu")
    int2 = dq.QVGConfig().allocate(**chunk)
    int4 = dq.QVGConfig(bits=4).allocate(**chunk)
    official = dq.QVGConfig.official().allocate(**chunk)
    assert int2.bits_per_element() <= 2.30
    assert int4.bits_per_element() <= 4.30
    # bpe = b + 8/Bq + 8*St/D + 16*St*K/N for the official configuration (METHOD.md section 2), plus the shift.
    formula = 2 + 8 / 64 + 8 / 128 + 16 * 256 / 4680 + 32 / (4680 * 128)
    assert official.bits_per_element() == pytest.approx(formula, rel=1e-12)
    assert official.bits_per_element() == pytest.approx(3.06, abs=0.005)


def residual_and_codes(packed, x):
    """The encoder's residual (x minus each stage's stored centroid, in order) and its decoded codes."""
    cfg = packed.config
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    b, n, h, d = x.shape
    r = x.to(f)
    for t in range(cfg.stages):
        scales = None if packed.centroid_scales is None else packed.centroid_scales[0, t]
        table = decode_centroids(packed.centroids[0, t], scales, f)  # [B, H, K, D]
        ids = packed.ids[..., t].long().permute(0, 2, 1)  # [B, H, N]
        r = r - torch.gather(table, 2, ids.unsqueeze(-1).expand(b, h, n, d)).permute(0, 2, 1, 3)
    r = r.unflatten(-1, (-1, cfg.group_size))
    shift = packed.scale_shift[0].view(b, 1, h, 1)
    u = unpack_codes(packed.codes, cfg)
    zeros = packed.zeros
    r_hat = dequantize_groups(u, packed.scales, zeros, shift, qmax=cfg.qmax, symmetric=cfg.symmetric, dtype=f)
    step = (packed.scales.to(f) * shift.to(f)).unsqueeze(-1)
    zero = 0 if zeros is None else (zeros.to(f) * shift.to(f)).unsqueeze(-1)
    return r, r_hat, step, zero


@pytest.mark.parametrize("name", ["int2", "int4", "int2-asym", "int4-asym", "fp16-scales", "absmax", "two-stages", "rtn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_residual_error_is_at_most_half_a_step_where_nothing_clamps(name, dtype):
    config = VARIANTS[name]
    x = clustered(dtype=dtype, noise=0.5)
    packed = dq.quantize(x, config)
    r, r_hat, step, zero = residual_and_codes(packed, x)
    level = (r - zero) / step
    low = -config.qmax if config.symmetric else 0
    inside = (step > 0) & (level >= low - 0.5) & (level <= config.qmax + 0.5)
    assert inside.float().mean() > 0.9  # the bound must be tested on most values, not vacuously
    assert ((r - r_hat).abs() <= step / 2)[inside].all()
    # The reference decoder adds exactly the stored centroids to this residual.
    assert torch.allclose(decode_tokens(packed, 0, N, 0), r_hat.flatten(-2) + (x.to(r.dtype) - r.flatten(-2)), atol=1e-5)


def test_mse_scale_search_never_does_worse_than_absmax_per_group():
    """Nor the fine grid than the coarse one, whose candidates it holds."""
    g = torch.Generator().manual_seed(3)
    r = torch.randn(2, 40, 3, 4, 16, generator=g) * torch.rand(2, 40, 3, 4, 1, generator=g)
    for symmetric in (True, False):
        errs = {}
        for search in ("absmax", "mse-coarse", "mse"):
            c = quantize_groups(r, bits=2, symmetric=symmetric, fmt=torch.float8_e4m3fn, search=search)
            qmax = 1 if symmetric else 3
            shift = c.shift.view(2, 1, 3, 1)
            r_hat = dequantize_groups(c.u, c.scales, c.zeros, shift, qmax=qmax, symmetric=symmetric, dtype=torch.float32)
            errs[search] = (r - r_hat).square().sum(-1)
        assert (errs["mse"] <= errs["mse-coarse"]).all() and (errs["mse-coarse"] <= errs["absmax"]).all()
        assert errs["mse"].sum() < 0.85 * errs["absmax"].sum()
        assert errs["mse-coarse"].sum() < 0.9 * errs["absmax"].sum()


def test_hand_checked_ternary_group():
    r = torch.tensor([1.0, -0.5, 0.2, 0.0]).view(1, 1, 1, 1, 4)
    c = quantize_groups(r, bits=2, symmetric=True, fmt=torch.float8_e4m3fn, search="absmax")
    # amax 1 -> shift 2^ceil(log2(1/448)) = 2^-8, scale e4m3(256) = 256, step 1; -0.5 rounds half to even (0).
    assert c.shift.item() == 2.0**-8 and c.scales.float().item() == 256.0
    assert c.u.flatten().tolist() == [2, 1, 1, 1]


def test_asymmetric_zero_extremes_are_positive_zero():
    # Groups of signed zeros: which zero a min or max returns depends on its order, so the stored zero and
    # scale would carry an order-dependent sign bit; they are +0.0 (byte 0), whatever the signs in the group.
    r = torch.tensor([[-0.0, 0.0, -0.0, 0.0], [-0.0, -0.0, -0.0, -0.0], [0.0, -0.0, 1.0, 2.0]]).view(1, 3, 1, 1, 4)
    for fmt in (torch.float8_e4m3fn, torch.float16):
        c = quantize_groups(r, bits=2, symmetric=False, fmt=fmt, search="mse")
        assert c.zeros.flatten().view(torch.uint8).view(-1, fmt.itemsize)[:, -1].tolist() == [0, 0, 0]
        assert c.scales.flatten()[:2].view(torch.uint8).view(-1, fmt.itemsize)[:, -1].tolist() == [0, 0]


def test_pow2_at_least_is_exact():
    v = torch.tensor([0.0, 1.0, 3.0, 4.0, 4.0001, 1e-40, 1e30])
    expected = [1.0, 1.0, 4.0, 4.0, 8.0, 2.0**-126, 2.0**100]
    assert pow2_at_least(v).tolist() == expected
    assert pow2_at_least(v.double()).tolist() == expected


@pytest.mark.parametrize("name", ["int2", "random", "two-stages", "int2-asym"])
def test_same_seed_same_bytes_and_global_rng_untouched(name):
    config = VARIANTS[name]
    x = clustered()
    state = torch.random.get_rng_state()
    a, b = dq.quantize(x, config), dq.quantize(x, config)
    assert torch.equal(torch.random.get_rng_state(), state)
    for key, tensor in a.tensors().items():
        assert torch.equal(tensor.view(torch.uint8), b.tensors()[key].view(torch.uint8)), key


def test_seed_changes_the_random_init():
    x = clustered(noise=1.0)
    a = dq.quantize(x, VARIANTS["random"])
    b = dq.quantize(x, VARIANTS["random"].with_(seed=1))
    assert not torch.equal(a.centroids, b.centroids)


@pytest.mark.parametrize("name", ["int2", "int4-asym", "fp16-scales", "bf16-centroids", "two-stages"])
@pytest.mark.parametrize("power", [-40, 20])
def test_power_of_two_rescaling_commutes_with_the_codec(name, power):
    """Tiny (~1e-12) and huge (~1e6) inputs neither underflow nor saturate: scales and shifts are relative."""
    config = VARIANTS[name]
    x = clustered()
    x_hat = dq.dequantize(dq.quantize(x, config))
    scaled = dq.dequantize(dq.quantize(x * 2.0**power, config))
    assert torch.isfinite(scaled).all()
    assert torch.equal(scaled, x_hat * 2.0**power)


@pytest.mark.parametrize("scale", [1e-30, 1e-12, 1e6, 1e12])
def test_extreme_magnitudes_stay_finite_and_bounded(scale):
    x = clustered() * scale
    for config in (VARIANTS["int2"], VARIANTS["int2-asym"], VARIANTS["rtn"]):
        x_hat = dq.dequantize(dq.quantize(x, config))
        assert torch.isfinite(x_hat).all()
        assert rel_l2(x_hat, x) < 0.6


def test_all_zero_input_decodes_to_zero():
    x = torch.zeros(B, N, H, D)
    for config in (VARIANTS["int2"], VARIANTS["int2-asym"]):
        packed = dq.quantize(x, config)
        assert torch.equal(dq.dequantize(packed), x)
        assert (packed.scale_shift == 1).all()


def test_e4m3_centroid_scales_are_powers_of_two_that_fit():
    c = 100 * torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    c[0, 0] = 0
    for mode, cols in (("centroid", 5), ("head", 1)):
        stored, scales = round_centroids(c, dq.QVGConfig(centroid_scale=mode))
        assert stored.dtype == torch.float8_e4m3fn and scales.shape == (3, cols)
        assert torch.equal(scales, pow2_at_least(scales))  # powers of two
        assert (stored.float().abs() <= 448).all() and torch.isfinite(stored.float()).all()
        amax = c.abs().amax(-1) if mode == "centroid" else c.abs().amax((-2, -1)).unsqueeze(-1)
        assert (amax / scales > 224).logical_or(amax == 0).all()  # the smallest power of two that fits
        assert rel_l2(decode_centroids(stored, scales, torch.float32), c) < 0.04


# --- k-means ---------------------------------------------------------------------------------------------


def test_strided_init_takes_evenly_spaced_tokens():
    x = torch.arange(10.0).view(1, 10, 1).expand(2, 10, 3)
    c = kmeans_init(x, 4, "strided", torch.Generator())
    assert c[0, :, 0].tolist() == [0.0, 2.0, 5.0, 7.0]


def test_kmeans_plusplus_finds_every_separated_cluster():
    g = torch.Generator().manual_seed(0)
    centers = 100 * torch.randn(3, 6, 8, generator=g)
    x = centers.repeat_interleave(20, dim=1) + 0.01 * torch.randn(3, 120, 8, generator=g)
    c = kmeans_init(x, 6, "kmeans++", torch.Generator().manual_seed(0))
    ids = assign(x, c)
    assert all(len(ids[p].unique()) == 6 for p in range(3))


def test_lloyd_keeps_empty_clusters_and_lowers_the_objective():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 50, 4, generator=g)
    init = torch.cat([x[:, :3], torch.full((2, 1, 4), 1e3)], dim=1)  # the last centroid attracts nobody
    out = lloyd(x, init, 3)
    assert torch.equal(out[:, 3], init[:, 3])

    def objective(c):
        return (x - torch.gather(c, 1, assign(x, c).unsqueeze(-1).expand(-1, -1, 4))).square().sum()

    assert objective(out) < objective(init)
    assert lloyd(x, init, 0) is init


def test_assign_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    x, c = torch.randn(3, 30, 5, generator=g, dtype=torch.float64), torch.randn(3, 7, 5, generator=g, dtype=torch.float64)
    brute = torch.cdist(x, c).argmin(-1)
    assert torch.equal(assign(x, c), brute)


# --- warm start and segments -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int2", "bf16-centroids", "e4m3-per-centroid", "two-stages"])
def test_warm_start_with_zero_iterations_reuses_the_given_centroids(name):
    config = VARIANTS[name]
    first = dq.quantize(clustered(seed=0), config)
    second = dq.quantize(clustered(seed=1), config.with_(kmeans_iters=0), warm_start=first)
    # The decoded tables are equal; bytes may differ by an exact power of two traded between value and scale.
    assert torch.equal(decoded_centroids(second), decoded_centroids(first))


def decoded_centroids(packed):
    return decode_centroids(packed.centroids, packed.centroid_scales, torch.float64)


def test_warm_start_on_the_same_clusters_matches_a_cold_start_quality():
    x0, x1 = clustered(seed=0, noise=0.1), clustered(seed=0, noise=0.1) + 0.01
    first = dq.quantize(x0, VARIANTS["int2"])
    warm = dq.dequantize(dq.quantize(x1, VARIANTS["int2"].with_(kmeans_iters=1), warm_start=first))
    cold = dq.dequantize(dq.quantize(x1, VARIANTS["int2"]))
    assert rel_l2(warm, x1) <= 1.05 * rel_l2(cold, x1)


def test_segments_in_slots_decode_like_single_tensors():
    config = VARIANTS["int2-asym"]
    a, b = clustered(seed=0), clustered(seed=1, n=40)
    storage = config.allocate(batch=B, capacity_tokens=100, heads=H, head_dim=D, num_slots=3, dtype=torch.float32, device="cpu")
    config.quantize_into(storage, a, token_start=0, slot=2)
    config.quantize_into(storage, b, token_start=N, slot=0)
    out = torch.zeros(B, 120, H, D)
    config.dequantize_into(storage, dq.segment_table([(N, 40, 0, 0), (0, N, 50, 2)]), out)
    assert torch.equal(out[:, :40], dq.dequantize(dq.quantize(b, config)))
    assert torch.equal(out[:, 50 : 50 + N], dq.dequantize(dq.quantize(a, config)))


# --- bad inputs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("bits", 3, "bits=3"),
        ("packing", "nibbles", "packing"),
        ("group_size", 0, "group_size"),
        ("scale_dtype", "bf16", "scale_dtype"),
        ("scale_search", "best", "scale_search"),
        ("num_centroids", 0, "num_centroids"),
        ("num_centroids", 2**15 + 1, "num_centroids"),
        ("kmeans_iters", -1, "kmeans_iters"),
        ("kmeans_init", "kmeans||", "kmeans_init"),
        ("stages", -1, "stages"),
        ("centroid_dtype", "int8", "centroid_dtype"),
        ("centroid_scale", "tensor", "centroid_scale"),
        ("seed", 1.5, "seed"),
    ],
)
def test_bad_config_fields_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        dq.QVGConfig(**{field: value})


def test_trits_need_symmetric_int2():
    with pytest.raises(ValueError, match="trit packing"):
        dq.QVGConfig(packing="trits", bits=4)


def snapshot(storage):
    return {k: v.clone() for k, v in storage.tensors().items()}


def assert_unchanged(storage, before):
    for key, tensor in storage.tensors().items():
        assert torch.equal(tensor.view(torch.uint8), before[key].view(torch.uint8)), key


BAD_INPUTS = [
    (lambda x: x[0], ValueError, "rank 4"),
    (lambda x: x.to(torch.int32), TypeError, "floating"),
    (lambda x: x[:, :0], ValueError, "empty"),
    (lambda x: x.index_put((torch.tensor([0]),), torch.tensor(float("nan"))), ValueError, "NaN or Inf"),
    (lambda x: x.index_put((torch.tensor([1]),), torch.tensor(float("inf"))), ValueError, "NaN or Inf"),
    (lambda x: x * 1e20, ValueError, "2\\^50"),
    (lambda x: x[:, :3], ValueError, "num_centroids 4 exceeds the 3 tokens"),
    (lambda x: x[..., :12], ValueError, "head_dim 12 is not divisible by group_size 8|batch/heads/head_dim"),
    (lambda x: x.double(), ValueError, "dtype"),
    (lambda x: x[:, :, :1], ValueError, "batch/heads/head_dim"),
]


@pytest.mark.parametrize("make, error, message", BAD_INPUTS)
def test_bad_inputs_raise_and_leave_the_storage_unchanged(make, error, message):
    config = VARIANTS["int2"]
    x = clustered()
    storage = dq.quantize(x, config)
    before = snapshot(storage)
    with pytest.raises(error, match=message):
        config.quantize_into(storage, make(x.clone()), token_start=0, slot=0)
    assert_unchanged(storage, before)


def test_head_dim_not_divisible_by_group_is_named():
    with pytest.raises(ValueError, match="head_dim 12 is not divisible by group_size 8"):
        dq.quantize(clustered(d=12), VARIANTS["int2"])


@pytest.mark.parametrize(
    "call, message",
    [
        (dict(token_start=10), "do not fit"),
        (dict(token_start=-1), "do not fit"),
        (dict(slot=1), "slot 1"),
        (dict(config=VARIANTS["int4"]), "allocated by"),
        (dict(warm_start="not storage"), "warm_start must be QVG storage"),
        (dict(warm_start="other heads"), "warm_start holds"),
        (dict(warm_start="more centroids"), "warm_start holds"),
        (dict(warm_start="self", warm_slot=1), "warm_slot 1"),
        (dict(warm_start="unwritten"), "never written"),
    ],
)
def test_bad_calls_raise_and_leave_the_storage_unchanged(call, message):
    config = VARIANTS["int2"]
    x = clustered()
    storage = dq.quantize(x, config)
    warm = {
        "not storage": dq.quantize(x, "bf16"),
        "other heads": dq.quantize(x[:, :, :1], config),
        "more centroids": dq.quantize(x, config.with_(num_centroids=5)),
        "self": storage,
        "unwritten": config.allocate(batch=B, capacity_tokens=N, heads=H, head_dim=D, num_slots=1, dtype=x.dtype, device="cpu"),
    }.get(call.get("warm_start"))
    before = snapshot(storage)
    codec = call.get("config", config)
    kwargs = dict(token_start=call.get("token_start", 0), slot=call.get("slot", 0), warm_start=warm, warm_slot=call.get("warm_slot", 0))
    with pytest.raises((ValueError, TypeError), match=message):
        codec.quantize_into(storage, x, **kwargs)
    assert_unchanged(storage, before)


def test_residual_quantizer_shapes_for_the_kernel_twin():
    config = dq.QVGConfig(bits=4, symmetric=False, group_size=8)
    codes = quantize_residual(torch.randn(2, 5, 3, 16), config)
    assert codes.u.shape == (2, 5, 3, 2, 8) and codes.u.dtype == torch.int32
    assert codes.scales.shape == codes.zeros.shape == (2, 5, 3, 2) and codes.scales.dtype == torch.float8_e4m3fn
    assert codes.shift.shape == (2, 3) and codes.shift.dtype == torch.float32
    assert 0 <= codes.u.min() and codes.u.max() <= 15


def test_qvg_beats_rtn_at_fewer_bits_on_clustered_data():
    x = clustered(b=1, n=512, h=2, d=64, clusters=16, noise=0.3)
    qvg = dq.quantize(x, dq.QVGConfig(num_centroids=16))
    for rtn_config in (dq.QVGConfig.rtn(), dq.QVGConfig.rtn(symmetric=False), dq.QVGConfig.rtn(group_size=32)):
        rtn = dq.quantize(x, rtn_config)
        assert qvg.bits_per_element() <= rtn.bits_per_element()
        assert rel_l2(dq.dequantize(qvg), x) < 0.5 * rel_l2(dq.dequantize(rtn), x)
    assert math.isclose(qvg.bits_per_element(), 1.625 + 0.125 + 0.125 + 0.25, rel_tol=1e-3)


def test_default_configs_run_end_to_end():
    x = clustered(b=1, n=300, h=1, d=128, clusters=8, noise=0.2, dtype=torch.bfloat16)
    for config in (dq.QVGConfig(), dq.QVGConfig(bits=4)):
        x_hat = dq.dequantize(dq.quantize(x, config))
        assert x_hat.dtype == torch.bfloat16 and rel_l2(x_hat, x) < (0.02 if config.bits == 4 else 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_encoder_uses_flash_kmeans_and_matches_the_cpu_quality():
    x = clustered(b=1, n=512, h=4, d=128, clusters=16, noise=0.3)
    config = dq.QVGConfig(num_centroids=32)
    cpu_state, cuda_state = torch.random.get_rng_state(), torch.cuda.get_rng_state()
    on_gpu = dq.quantize(x.cuda(), config)
    assert torch.equal(torch.random.get_rng_state(), cpu_state) and torch.equal(torch.cuda.get_rng_state(), cuda_state)
    gpu_err = rel_l2(dq.dequantize(on_gpu).cpu(), x)
    cpu_err = rel_l2(dq.dequantize(dq.quantize(x, config)), x)
    assert gpu_err <= 1.05 * cpu_err
    r, r_hat, step, zero = residual_and_codes(on_gpu, x.cuda())
    inside = (step > 0) & ((r / step).abs() <= config.qmax + 0.5)
    assert ((r - r_hat).abs() <= step / 2)[inside].all()


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 4]),
    symmetric=st.booleans(),
    fmt=st.sampled_from([torch.float8_e4m3fn, torch.float16]),
    search=st.sampled_from(["absmax", "mse"]),
    log_scale=st.integers(-30, 30),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_group_quantizer_error_bound_holds_for_any_settings(bits, symmetric, fmt, search, log_scale, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    r = (torch.randn(2, 6, 3, 2, 8, generator=g) * 2.0 ** torch.randint(-4, 5, (2, 6, 3, 2, 1), generator=g)).to(dtype)
    r = r * 2.0**log_scale
    c = quantize_groups(r, bits=bits, symmetric=symmetric, fmt=fmt, search=search)
    qmax = 2 ** (bits - 1) - 1 if symmetric else 2**bits - 1
    shift = c.shift.view(2, 1, 3, 1)
    r_hat = dequantize_groups(c.u, c.scales, c.zeros, shift, qmax=qmax, symmetric=symmetric, dtype=dtype)
    assert torch.isfinite(r_hat).all()
    step = (c.scales.to(dtype) * shift.to(dtype)).unsqueeze(-1)
    zero = 0 if c.zeros is None else (c.zeros.to(dtype) * shift.to(dtype)).unsqueeze(-1)
    level = (r - zero) / step
    inside = (step > 0) & (level >= (-qmax if symmetric else 0) - 0.5) & (level <= qmax + 0.5)
    assert ((r - r_hat).abs() <= step / 2)[inside].all()
    assert (c.u >= 0).all() and (c.u <= (2 * qmax if symmetric else qmax)).all()
