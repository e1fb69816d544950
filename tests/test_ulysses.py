"""One video on several ranks: diffusers' Ulysses context parallelism with a head-sharded cache (CPU, gloo).

Two ``torchrun`` launches (2 and 4 ranks) run every check of ``ulysses_checks.py`` on every rank; each test
here reads one check's verdict from all ranks. What they hold: outputs bitwise equal to one process (bf16
and qvg-int2 storage, float64, both commit modes, sink + window, CFG as batch 2, both install orders, the
shared processor, all three k-means inits), each rank storing exactly its heads' bytes of the single
process's cache (1/N), refused configurations (ring, ring x Ulysses, ``ulysses_anything``, indivisible heads
or tokens) raising on every rank at install or at the first chunk, a bad write on one rank refused on every
rank without a hang, ``disable_qvg`` keeping the parallel config, and the pipeline, ``qvg-generate --ulysses``
and ``bench_e2e --ulysses`` on the same path. A hung collective fails its check after 120 s (the process
group's timeout); a hung launch fails every test after ``TIMEOUT``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ulysses_checks import checks

WORKER = Path(__file__).with_name("ulysses_checks.py")
TIMEOUT = 900


def launch(world: int, out: Path) -> list[dict[str, str]]:
    """Run the worker on ``world`` ranks; every rank's ``{check: "ok" or its error}``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               str(WORKER), str(out)]
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the {world}-rank launch did not finish in {TIMEOUT} s:\n{(hung.stderr or b'')[-3000:]}")
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch(2, tmp_path_factory.mktemp("two_ranks"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return launch(4, tmp_path_factory.mktemp("four_ranks"))


def assert_ok_on_every_rank(results: list[dict[str, str]], name: str) -> None:
    failed = {rank: r.get(name, "not run") for rank, r in enumerate(results) if r.get(name) != "ok"}
    assert not failed, "\n".join(f"rank {rank}: {error}" for rank, error in failed.items())


@pytest.mark.parametrize("name", list(checks(2, Path())))
def test_two_ranks(two_ranks, name):
    assert_ok_on_every_rank(two_ranks, name)


@pytest.mark.parametrize("name", list(checks(4, Path())))
def test_four_ranks(four_ranks, name):
    assert_ok_on_every_rank(four_ranks, name)
