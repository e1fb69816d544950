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
    assert {r.attention for r in rows} == {"dispatch"}
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


def test_sageattention_rows_hold_the_dense_window_and_the_caches_against_the_same_anchor():
    """SageAttention 1.0.6's kernels (interpreted here) over the dense window and each cache's window; the anchor
    (dense + dispatch) runs first even when only the 8-bit attention is asked for."""
    rows = load().main([*SMALL, "--attention", "sageattention-1.0.6", "--configs", "pipeline: final-pass, keep 0"])
    assert [(r.variant, r.attention) for r in rows] == [
        ("dense", "dispatch"), ("dense", "sageattention-1.0.6"),
        ("cache:bf16", "sageattention-1.0.6"), ("cache:qvg-int2", "sageattention-1.0.6"),
    ]
    assert all(r.error is None and math.isfinite(r.ms) for r in rows)
    anchor = rows[0].ms
    assert rows[0].ratio == 1.0 and all(r.ratio == pytest.approx(r.ms / anchor) for r in rows[1:])


def test_the_cache_step_attends_with_the_named_attention_to_the_window_the_cache_returns(monkeypatch):
    """A cache row's named attention is what reads the cache's window, the current chunk included."""
    module = load()
    seen = []

    def recording(q, k, v):
        seen.append((k.data_ptr(), v.data_ptr(), k.shape[1]))
        return module.sageattention_1(q, k, v)

    monkeypatch.setitem(module.ATTENTION, "sageattention-1.0.6", recording)
    rows = module.main([*SMALL, "--attention", "sageattention-1.0.6", "--storages", "bf16",
                        "--configs", "on-advance, keep 1"])
    assert [r.error for r in rows] == [None, None, None]
    # the dense row and the cache row, one timed call each (no warmup); the 6-frame window is 3 chunks of 256 tokens
    assert len(seen) == 2 and {tokens for _, _, tokens in seen} == {3 * 256}
