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
                     "ours, 1 launch per tensor, K +RoPE and V", "K +RoPE (RotaryPairs) and V in 1 launch",
                     "dequantize_pair_into", "torch reference decoder", "plain 2-bit unpack",
                     "nvfp4 (LongLive-2's format): ours, K +RoPE (RotaryPairs) and V in 1 launch",
                     "copy roofline"):
        assert any(expected in n for n in names), expected
    flash = next(r for r in report["rows"] if "flash-kmeans" in r["name"])
    if not torch.cuda.is_available():  # flash-kmeans needs CUDA: its failure is its row, the rows after it still run
        assert flash["ms"] is None and flash["error"] == "AssertionError: All tensors must be on CUDA"
        assert "| failed |" in result.stdout and "ERROR AssertionError" in result.stdout
    later = report["rows"][report["rows"].index(flash) + 1:]
    assert [r["section"] for r in later].count("dequantize") == 10
    launches = [r for r in report["rows"] if r["section"] == "launches"]
    if not torch.cuda.is_available():  # the interpreter runs nothing on a device: one row says so
        assert [(r["name"], r["ms"], r["note"]) for r in launches] == [
            ("qvg-int2: a layer group's K and V: device time per launch", None,
             "not run: no CUDA device, so no device kernels to profile")]
    else:  # the encoder's launches, each timed, then their sum
        assert len(launches) >= 3 and launches[-1]["ms"] == pytest.approx(sum(r["ms"] for r in launches[:-1]))
    assert all(r["ms"] > 0 and r["error"] is None for r in report["rows"] if r is not flash and r not in launches)
    assert next(r for r in report["rows"] if r["name"].startswith("copy roofline"))["fraction_of_copy"] == pytest.approx(1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the full-size run is the GPU's")
def test_full_size_without_cuda_asks_for_small():
    result = run()
    assert result.returncode == 2 and "pass --small" in result.stderr
