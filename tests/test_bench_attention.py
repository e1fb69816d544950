"""The attention benchmark runs end to end on CPU at small sizes (GPU figures are taken with the same script)."""

import json
import math

import pytest
from script_modules import load_script

SMALL = ["--small", "--device", "cpu", "--windows", "6", "--warmup", "0", "--repeats", "1"]


def load():
    return load_script("bench_attention")


def test_small_cpu_run_reports_every_variant_in_both_cache_configurations(tmp_path):
    out = tmp_path / "rows.json"
    rows = load().main([*SMALL, "--json", str(out)])
    assert [(r.variant, r.config) for r in rows] == [
        ("dense", "dense window"),
        ("cache:bf16", "on-advance, keep 1"), ("cache:qvg-int2", "on-advance, keep 1"),
        ("cache:bf16", "pipeline: final-pass, keep 0"), ("cache:qvg-int2", "pipeline: final-pass, keep 0"),
    ]
    assert all(math.isfinite(r.ms) and r.ms > 0 and r.step_peak_mib is None and r.error is None for r in rows)
    dense, bf16, qvg, bf16_pipeline, qvg_pipeline = rows
    assert dense.ratio == 1.0 and qvg.resident_mib < bf16.resident_mib  # a packed chunk takes less than BF16
    # The pipeline's configuration stores only the 2 finished chunks of the 3 (none for the chunk being
    # denoised), and packs both.
    assert bf16_pipeline.resident_mib == pytest.approx(bf16.resident_mib * 2 / 3)
    assert qvg_pipeline.resident_mib < qvg.resident_mib
    assert len(json.loads(out.read_text())) == 5


def test_a_failing_row_is_recorded_and_the_others_run(tmp_path):
    out = tmp_path / "rows.json"
    rows = load().main([*SMALL, "--storages", "int3", "bf16", "--configs", "pipeline: final-pass, keep 0",
                        "--json", str(out)])
    assert [(r.variant, r.error is None) for r in rows] == [("dense", True), ("cache:int3", False), ("cache:bf16", True)]
    assert rows[1].error.startswith("ValueError: unknown KV cache storage 'int3'") and math.isnan(rows[1].ms)
    assert json.loads(out.read_text())[1]["error"] == rows[1].error
