"""The kernel benchmark runs end to end at small sizes (CPU: Triton's interpreter) and reports every row."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), *args], capture_output=True, text=True, env=env, cwd=ROOT)


def test_small_run_prints_the_table_and_json(tmp_path):
    result = run("--small", "--repeats", "1", "--warmup", "0", "--json", str(tmp_path / "bench.json"))
    assert result.returncode == 0, result.stderr
    assert "| section | row | ms | target ms | GB/s | of copy bw | note |" in result.stdout
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["meta"]["data"].startswith("video-derived")
    names = [r["name"] for r in report["rows"]]
    for expected in ("residual codes, 2 launches (ours)", "Lloyd iters, deterministic Triton (ours",
                     "K and V of a layer, one quantize_batch_into call (ours)",
                     "ours, 1 launch per tensor, K +RoPE and V", "torch reference decoder", "plain 2-bit unpack",
                     "copy roofline"):
        assert any(expected in n for n in names), expected
    assert all(r["ms"] > 0 for r in report["rows"])
    assert next(r for r in report["rows"] if r["name"].startswith("copy roofline"))["fraction_of_copy"] == pytest.approx(1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the full-size run is the GPU's")
def test_full_size_without_cuda_asks_for_small():
    result = run()
    assert result.returncode == 2 and "pass --small" in result.stderr
