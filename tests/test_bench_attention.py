"""The attention benchmark runs end to end on CPU at small sizes (GPU figures are taken with the same script)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_attention.py"


def test_small_cpu_run_reports_every_variant(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_attention", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    rows = bench.main(["--small", "--device", "cpu", "--windows", "6", "--warmup", "0", "--repeats", "1", "--json", str(out)])
    assert [r.variant for r in rows] == ["dense", "cache:bf16", "cache:qvg-int2"]
    assert all(math.isfinite(r.ms) and r.ms > 0 and r.step_peak_mib is None for r in rows)
    dense, bf16, qvg = rows
    assert dense.ratio == 1.0 and qvg.resident_mib < bf16.resident_mib  # a packed chunk takes less than BF16
    assert len(json.loads(out.read_text())) == 3
