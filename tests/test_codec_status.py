"""Writes checked on the device (``status=``): a failed write stores nothing, the first failure is raised later.

Without a status a codec raises at once (tests/test_codec_base.py); with one, it folds its check into the
status and predicates its stores, so the device is never read per write.
"""

import pytest
import torch

import diffusers_qvg as dq
from diffusers_qvg.codecs.status import WriteStatus

CODECS = {
    "bf16": (dq.BF16Config(), "value"),
    "qvg": (dq.QVGConfig(num_centroids=4), "value"),
    "rtn": (dq.QVGConfig.rtn(), "value"),
    "kivi-keys": (dq.KIVIConfig(key_group_tokens=8), "key"),
}


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
    config.quantize_into(storage, x, token_start=16, slot=1, role=role, status=status, what="layer 0 key")
    reference = config.allocate(batch=1, capacity_tokens=32, heads=2, head_dim=64, num_slots=2, dtype=torch.float32, device="cpu", role=role)
    config.quantize_into(reference, x, token_start=16, slot=1, role=role)
    assert_same_bytes(storage, storage_bytes(reference))
    status.raise_if_failed()  # nothing failed


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("bad", ["nan", "inf", "huge"])
def test_a_failed_write_stores_nothing_and_raises_later(name, bad):
    config, role, storage, x = setup(name)
    config.quantize_into(storage, x, token_start=0, slot=0, role=role)
    before = storage_bytes(storage)
    status = WriteStatus("cpu")
    poisoned = x.clone()
    poisoned[0, 3, 1, 7] = {"nan": float("nan"), "inf": float("inf"), "huge": 2.0**60}[bad]
    if bad == "huge" and name == "bf16":
        config.quantize_into(storage, poisoned, token_start=16, slot=1, role=role, status=status, what="w")
        status.raise_if_failed()  # bf16 stores any finite value
        return
    config.quantize_into(storage, poisoned, token_start=16, slot=1, role=role, status=status, what="layer 3 value")
    assert_same_bytes(storage, before)
    # Every later write is refused too, even a good one: the cache's layers must not disagree.
    config.quantize_into(storage, x, token_start=16, slot=1, role=role, status=status, what="layer 4 value")
    assert_same_bytes(storage, before)
    message = "NaN or Inf values" if bad != "huge" else "values up to 1.15e\\+18"
    with pytest.raises(ValueError, match=f"{message} in layer 3 value;"):
        status.raise_if_failed()
    status.raise_if_failed()  # cleared by the raise


def test_a_failed_condition_raises_its_own_message():
    config = dq.QVGConfig(num_centroids=4)
    storage = config.allocate(batch=1, capacity_tokens=32, heads=2, head_dim=64, num_slots=2, dtype=torch.float32, device="cpu")
    x = torch.randn(1, 16, 2, 64, generator=torch.Generator().manual_seed(0))
    before = storage_bytes(storage)
    status = WriteStatus("cpu")
    config.quantize_into(storage, x, token_start=16, slot=1, warm_start=storage, warm_slot=0, status=status, what="w")
    assert_same_bytes(storage, before)
    with pytest.raises(ValueError, match="warm_slot 0 of warm_start was never written"):
        status.raise_if_failed()


def test_the_status_lives_on_one_device():
    status = WriteStatus("cpu")
    with pytest.raises(ValueError, match="write status is on cpu"):
        status.check(torch.zeros(2, device="meta"), "x", None)
