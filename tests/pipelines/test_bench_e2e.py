"""scripts/bench_e2e.py runs at small size on the CPU and reports the BF16 anchor and QVG (the pipeline's
keep_recent_chunks 0, and 1) in one table."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_e2e.py"


def test_bench_e2e_small(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--small", "--json", str(tmp_path / "rows.json")])
    settings = [(r["storage"], r["keep_recent_chunks"], r["latent_frames"], r["chunks"]) for r in rows]
    assert settings == [("bf16", 0, 9, 3), ("qvg-int2", 0, 9, 3), ("qvg-int2", 1, 9, 3)]
    bf16, qvg_packed, qvg = rows
    assert qvg["bf16_bytes"] == qvg_packed["bf16_bytes"] == bf16["bf16_bytes"] > 0  # the same tokens are cached
    assert 0 < qvg_packed["kv_bytes"] < qvg["kv_bytes"] < bf16["kv_bytes"]
    assert all(r["seconds_per_chunk"] > 0 and r["peak_bytes"] is None for r in rows)
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    table = capsys.readouterr().out
    assert "| 9 | bf16 | 0 |" in table and "| 9 | qvg-int2 | 1 |" in table and "| 9 | qvg-int2 | 0 |" in table
    assert "+0.0%" in table and "| anchor |" in table and ">= 6.5x" in table
