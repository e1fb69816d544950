"""Writes checked on the device (``status=``): a failed write stores nothing, the first failure is raised later.

Without a status a codec raises at once (tests/test_codec_base.py); with one, it folds its check into the
status and predicates its stores, so the device is never read per write.
"""

import contextlib

import pytest
import torch

import diffusers_qvg as dq
from diffusers_qvg.codecs.qvg import backend
from diffusers_qvg.codecs.status import WriteStatus

CODECS = {
    "bf16": (dq.BF16Config(), "value"),
    "qvg": (dq.QVGConfig(num_centroids=4), "value"),
    "rtn": (dq.QVGConfig.rtn(), "value"),
    "kivi-keys": (dq.KIVIConfig(key_group_tokens=8), "key"),
    "nvfp4": (dq.NVFP4Config(), "value"),
    # The Triton encoders (in the interpreter on CPU): QVG's checks inside its kernels and gates every store there,
    # NVFP4's encodes into temporaries that the gated copies store.
    "qvg-triton": (dq.QVGConfig(num_centroids=4, kmeans_iters=1), "value"),
    "rtn-triton": (dq.QVGConfig.rtn(), "value"),
    "nvfp4-triton": (dq.NVFP4Config(), "value"),
}


def path(name):
    """The backend a codec's writes run on: Triton for the ``-triton`` cases, else the default."""
    return backend("triton") if name.endswith("-triton") else contextlib.nullcontext()


def storage_bytes(storage: dq.Packed) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in storage.tensors().items()}


def assert_same_bytes(storage: dq.Packed, before: dict[str, torch.Tensor]) -> None:
    for name, t in storage.tensors().items():
        assert torch.equal(t.view(torch.uint8), before[name].view(torch.uint8)), name


def setup(name):
    config, role = CODECS[name]
    storage = config.allocate(batch=1, capacity_tokens=32, heads=2, head_dim=64, num_slots=2, dtype=torch.float32, device="cpu", role=role)
    x = torch.randn(1, 16, 2, 64, generator=torch.Generator().manual_seed(0))
    return config, role, storage, x


@pytest.mark.parametrize("name", CODECS)
def test_a_passing_write_stores_what_an_unchecked_one_stores(name):
    config, role, storage, x = setup(name)
    status = WriteStatus("cpu")
    reference = config.allocate(batch=1, capacity_tokens=32, heads=2, head_dim=64, num_slots=2, dtype=torch.float32, device="cpu", role=role)
    with path(name):
        config.quantize_into(storage, x, token_start=16, slot=1, role=role, status=status, what="layer 0 key")
        config.quantize_into(reference, x, token_start=16, slot=1, role=role)
    assert_same_bytes(storage, storage_bytes(reference))
    status.raise_if_failed()  # nothing failed


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("bad", ["nan", "inf", "huge"])
def test_a_failed_write_stores_nothing_and_raises_later(name, bad):
    config, role, storage, x = setup(name)
    with path(name):
        config.quantize_into(storage, x, token_start=0, slot=0, role=role)
    before = storage_bytes(storage)
    status = WriteStatus("cpu")
    poisoned = x.clone()
    poisoned[0, 3, 1, 7] = {"nan": float("nan"), "inf": float("inf"), "huge": 2.0**60}[bad]
    if bad == "huge" and name == "bf16":
        config.quantize_into(storage, poisoned, token_start=16, slot=1, role=role, status=status, what="w")
        status.raise_if_failed()  # bf16 stores any finite value
        return
    with path(name):
        config.quantize_into(storage, poisoned, token_start=16, slot=1, role=role, status=status, what="layer 3 value")
        assert_same_bytes(storage, before)
        # Every later write is refused too, even a good one: the cache's layers must not disagree.
        config.quantize_into(storage, x, token_start=16, slot=1, role=role, status=status, what="layer 4 value")
    assert_same_bytes(storage, before)
    message = "NaN or Inf values" if bad != "huge" else "values up to 1.15e\\+18"
    with pytest.raises(ValueError, match=f"{message} in layer 3 value;"):
        status.raise_if_failed()
    status.raise_if_failed()  # cleared by the raise


@pytest.mark.parametrize("mode", ["torch", "triton"])
def test_a_failed_condition_raises_its_own_message(mode):
    config = dq.QVGConfig(num_centroids=4)
    storage = config.allocate(batch=1, capacity_tokens=32, heads=2, head_dim=64, num_slots=2, dtype=torch.float32, device="cpu")
    x = torch.randn(1, 16, 2, 64, generator=torch.Generator().manual_seed(0))
    before = storage_bytes(storage)
    status = WriteStatus("cpu")
    with backend(mode):
        config.quantize_into(storage, x, token_start=16, slot=1, warm_start=storage, warm_slot=0, status=status, what="w")
    assert_same_bytes(storage, before)
    with pytest.raises(ValueError, match="warm_slot 0 of warm_start was never written"):
        status.raise_if_failed()


def test_the_status_lives_on_one_device():
    status = WriteStatus("cpu")
    with pytest.raises(ValueError, match="write status is on cpu"):
        status.check(torch.zeros(2, device="meta"), "x", None)


@pytest.mark.parametrize("mode", ["torch", "triton"])
def test_in_a_batch_each_write_sees_only_the_failures_before_it(mode):
    """Items checked together keep the order of one write after another: the first bad item's message is
    raised, the items before it are stored, it and every item after it are refused; the condition of a later
    item does not hide the earlier item's own failure."""
    config = dq.QVGConfig(num_centroids=4, kmeans_iters=1)
    storages = [config.allocate(batch=1, capacity_tokens=16, heads=2, head_dim=64, num_slots=1, dtype=torch.float32, device="cpu") for _ in range(4)]
    x = torch.randn(1, 16, 2, 64, generator=torch.Generator().manual_seed(0))
    huge = x.clone()
    huge[0, 0, 0, 0] = -(2.0**52)
    reference = config.allocate(batch=1, capacity_tokens=16, heads=2, head_dim=64, num_slots=1, dtype=torch.float32, device="cpu")
    status = WriteStatus("cpu")
    with backend(mode):
        config.quantize_into(reference, x, token_start=0, slot=0)
        items = [(s, t, 0, 0) for s, t in zip(storages, (x, x, huge, x))]
        warm = [None, None, None, (storages[3], 0)]  # the last one's warm slot was never written
        config.quantize_batch_into(items, warm_starts=warm, status=status, whats=["L0 K", "L0 V", "L1 K", "L1 V"])
    for s in storages[:2]:
        assert_same_bytes(s, storage_bytes(reference))
    for s in storages[2:]:
        assert (s.scale_shift == 0).all() and (s.codes == 0).all()
    with pytest.raises(ValueError, match="values up to 4.5e\\+15 in L1 K;"):
        status.raise_if_failed()
