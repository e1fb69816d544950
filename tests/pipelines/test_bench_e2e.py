"""scripts/bench_e2e.py runs at small size on the CPU and reports the BF16 anchor and QVG in one table."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_e2e.py"


def test_bench_e2e_small(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--small", "--json", str(tmp_path / "rows.json")])
    assert [(r["storage"], r["latent_frames"], r["chunks"]) for r in rows] == [("bf16", 9, 3), ("qvg-int2", 9, 3)]
    bf16, qvg = rows
    assert qvg["bf16_bytes"] == bf16["bf16_bytes"] > 0  # the same tokens are cached
    assert 0 < qvg["kv_bytes"] < bf16["kv_bytes"]
    assert all(r["seconds_per_chunk"] > 0 and r["peak_bytes"] is None for r in rows)
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    table = capsys.readouterr().out
    assert "| 9 | bf16 |" in table and "| 9 | qvg-int2 |" in table and "+0.0%" in table
