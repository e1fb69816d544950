"""Triton k-means pieces: nearest-centroid assignment and the deterministic centroid update."""

import pytest
import torch
from flash_kmeans.torch_fallback import batch_kmeans_Euclid_torch_native

from diffusers_qvg.codecs.qvg.triton.assign import assign
from diffusers_qvg.codecs.qvg.triton.centroid_update import lloyd, update_centroids


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled kernels on GPU, interpreted on CPU


def points(P=3, N=101, D=48, seed=0):
    return torch.randn(P, N, D, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def exact_nearest(x, c):
    return torch.cdist(x.double(), c.double()).argmin(-1)


def test_assignment_is_the_nearest_centroid_across_centroid_blocks():
    x = points()
    c = points(N=37, seed=1)  # 37 centroids: two blocks, the second partial
    ids = assign(x, c)
    assert ids.dtype == torch.int32 and ids.shape == (3, 101)
    assert torch.equal(ids.long(), exact_nearest(x, c))


def test_assignment_over_whole_centroid_blocks():
    """128 centroids: two whole blocks, the kernel's unmasked variant (the default 256 takes it too)."""
    x = points(P=2, N=150, D=32)
    c = points(P=2, N=128, D=32, seed=1)
    assert torch.equal(assign(x, c).long(), exact_nearest(x, c))


def test_assignment_ties_go_to_the_lower_index_within_and_across_blocks():
    # Small integers: every product and sum is exact, so equal centroids score equal in any order of addition
    # (the interpreter's matmul is BLAS's, whose kernels can round two equal columns differently).
    x, c = points(P=1, N=64).round(), points(P=1, N=40, seed=1).round()
    c[0, 35] = c[0, 3] = x[0, 0]  # equal centroids 32 apart: different blocks
    c[0, 9] = c[0, 7] = x[0, 1]  # equal centroids in one block
    ids = assign(x, c)
    assert ids[0, 0] == 3 and ids[0, 1] == 7


def test_assignment_of_nan_and_inf_points_stays_in_range():
    """Such a write is refused later, but its ids index tables first: never a masked centroid (37 of a 64-block)."""
    x = points()
    x[0, 3] = float("nan")
    x[1, 5, 0] = float("inf")
    c = points(N=37, seed=1)
    ids = assign(x, c)
    assert ((ids >= 0) & (ids < 37)).all()
    finite = torch.isfinite(x).all(-1)
    assert torch.equal(ids.long()[finite], exact_nearest(x, c)[finite])


def test_assignment_reads_strided_points():
    x = points(P=2, N=50, D=32).transpose(0, 1).contiguous().transpose(0, 1)  # problem-minor memory
    c = x[:, ::5]
    assert not (x.is_contiguous() or c.is_contiguous())
    assert torch.equal(assign(x, c).long(), exact_nearest(x, c))


def test_update_is_the_cluster_mean_and_empty_clusters_keep_theirs():
    x = points()
    ids = torch.randint(0, 6, (3, 101), generator=torch.Generator().manual_seed(2)).to(DEVICE)  # clusters 6, 7 stay empty
    old = points(N=8, seed=3)
    new = update_centroids(x, ids, old)
    for k in range(6):
        mask = ids == k
        expected = torch.stack([x[p][mask[p]].double().mean(0) for p in range(3)])
        torch.testing.assert_close(new[:, k].double(), expected, rtol=0, atol=1e-6)
    assert torch.equal(new[:, 6:], old[:, 6:])
    assert torch.equal(update_centroids(x, ids, old), new)  # same bits on a second run


@pytest.mark.parametrize("scale", [2.0**-10, 2.0**-133])
def test_update_means_are_the_float32_quotient(scale):
    """Each mean is its members' sum divided by their count in float32, bit for bit, subnormal means (the
    smaller scale) included: small integers times a power of two, so that every sum is exact."""
    P, N, K = 2, 333, 150
    g = torch.Generator().manual_seed(6)
    x = (torch.randint(-50, 51, (P, N, 32), generator=g).float() * scale).to(DEVICE)
    ids = torch.randint(0, K, (P, N), generator=g).to(DEVICE, torch.int32)
    new = update_centroids(x, ids, points(P=P, N=K, D=32, seed=7)).cpu()
    x, ids = x.cpu(), ids.cpu()
    subnormal = 0
    for p in range(P):
        for k in ids[p].unique().tolist():
            members = x[p][ids[p] == k]
            expected = members.double().sum(0).float() / len(members)  # the exact sum, divided in float32
            assert torch.equal(new[p, k].view(torch.int32), expected.view(torch.int32)), (p, k)
            subnormal += int(((expected.abs() < 2.0**-126) & (expected != 0)).sum())
    assert (subnormal > 0) == (scale < 2.0**-126)


@pytest.mark.parametrize("skew", ["uniform", "one block", "one cluster"])
def test_update_gathers_each_centroid_blocks_members(skew):
    """150 centroids: five programs of 32 per problem (the last partial), each summing only its members."""
    P, N, K = 2, 333, 150
    x = points(P=P, N=N, D=32)
    g = torch.Generator().manual_seed(4)
    ids = {
        "uniform": torch.randint(0, K, (P, N), generator=g),
        "one block": torch.randint(64, 128, (P, N), generator=g),  # programs 0, 1 and 4 have no members
        "one cluster": torch.full((P, N), K - 1),  # every token in the partial block's last centroid
    }[skew].to(DEVICE, torch.int32)
    old = points(P=P, N=K, D=32, seed=5)
    new = update_centroids(x, ids, old)
    expected = old.double().clone()
    for p in range(P):
        for k in ids[p].unique().tolist():
            expected[p, k] = x[p][ids[p] == k].double().mean(0)
    torch.testing.assert_close(new.double(), expected, rtol=0, atol=1e-6)
    assert torch.equal(update_centroids(x, ids, old), new)


def test_lloyd_matches_flash_kmeans_torch_fallback():
    x = points(P=2, N=120, D=32)
    init = x[:, :10].clone()
    _, expected, _ = batch_kmeans_Euclid_torch_native(x, 10, max_iters=3, tol=0.0, init_centroids=init.clone())
    torch.testing.assert_close(lloyd(x, init, 3), expected, rtol=0, atol=1e-5)
    assert torch.equal(lloyd(x, init, 0), init)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lloyd_with_incremental_updates_is_the_reference_lloyd(dtype):
    """Updates 2 on change only the clusters whose tokens moved (the kept sums, plus joiners, minus leavers):
    Lloyd still matches the reference's, which averages afresh each time. Points near a plane in 32
    dimensions, 40 centroids from the first points: 40-60 tokens move at iteration 2, still a few at 6."""
    from diffusers_qvg.codecs.qvg.kmeans import lloyd as reference_lloyd

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 200, 2, generator=g) @ torch.randn(2, 2, 32, generator=g) + 0.01 * torch.randn(2, 200, 32, generator=g)
    x = x.to(dtype).to(DEVICE)
    init = x[:, :40].float()
    for iters in (2, 6):
        expected = reference_lloyd(x.float(), init, iters, "bf16")
        torch.testing.assert_close(lloyd(x, init, iters, "bf16"), expected, rtol=0, atol=2e-5)


def test_an_incremental_update_empties_and_refills_clusters():
    """Three updates of one problem (two programs: 32 + 8 centroids; 2,500 tokens: three blocks of the ids'
    scan) under given ids: full, then two incremental ones where clusters 3 and 35 lose every token and 3 gets
    some back. Each time every cluster is its tokens' mean, an empty one keeps its centroid, and the kept
    sizes are the counts."""
    from diffusers_qvg.codecs.qvg.triton.centroid_update import launch_update
    from diffusers_qvg.codecs.qvg.triton.problems import points_problems

    N, K = 2500, 40
    x = points(P=1, N=N, D=32)
    g = torch.Generator().manual_seed(9)
    a = torch.randint(0, K, (1, N), generator=g)
    a[0, :6] = torch.tensor([3, 3, 35, 35, 3, 35])
    b = a.clone()
    b[b == 3], b[b == 35] = 5, 36  # emptied, their tokens moved within and across the programs
    c = b.clone()
    c[0, [0, 1, 2000]] = 3  # refilled
    pr = points_problems(x, K, "bf16")
    pr.working.copy_(points(P=1, N=K, D=32, seed=10))
    previous, _, counts = pr.lloyd_scratch()
    for i, ids in enumerate((a, b, c)):
        previous.copy_(pr.ids[0])  # as each Lloyd assignment keeps the ids it replaces
        pr.ids[0].copy_(ids.to(DEVICE, torch.int32))
        old = pr.working.clone()
        launch_update(pr, 0, delta=i > 0, operands="bf16")
        expected = old.double().clone()
        for k in ids[0].unique().tolist():
            expected[0, k] = x[0][ids[0] == k].double().mean(0)
        torch.testing.assert_close(pr.working.double(), expected, rtol=0, atol=1e-6)
        assert torch.equal(counts[0].cpu(), torch.bincount(ids[0], minlength=K).int())
    assert (b == 3).sum() == 0 and (c == 3).sum() == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lloyd_at_self_forcing_size_is_deterministic_and_agrees_with_flash_kmeans():
    from flash_kmeans import batch_kmeans_Euclid

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(12, 4680, 128, device="cuda", generator=g)
    init = x[:, ::18][:, :256].contiguous()
    a, b = lloyd(x, init, 5), lloyd(x, init, 5)
    assert torch.equal(a, b)
    ids = assign(x, a).long()
    agree = (ids == exact_nearest(x, a)).float().mean().item()
    assert agree > 0.999
    _, theirs, _ = batch_kmeans_Euclid(x, 256, max_iters=5, tol=0.0, init_centroids=init.clone())

    def inertia(c):  # the k-means objective: ours must be as good as flash-kmeans' from the same init
        return torch.cdist(x.double(), c.double()).amin(-1).square().sum().item()

    assert inertia(a) <= inertia(theirs) * 1.001
