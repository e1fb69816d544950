"""scripts/bench_soak.py --small: a stream of 3 windows past a 16-frame RoPE table, with prompt switches and their
re-cache. Once the window is full the cache's memory report stays the same and no storage is reallocated."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_soak.py"


def test_memory_is_flat_and_storage_stays_put_once_the_window_is_full(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_soak", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    runs = bench.main(["--small", "--json", str(tmp_path / "soak.json")])
    (run,) = runs
    rows, summary = run["rows"], run["summary"]
    assert len(rows) == 12 and run["settings"]["latent_frames"] == 36 > run["settings"]["rope_max_seq_len"] == 16
    assert [r["chunk"] for r in rows if r["switch"]] == [4, 8]
    # window 12 = the sink (3) and three chunks: the fourth chunk (index 3) is the first to see a full window
    full = 3
    assert all(r["memory"] == rows[full]["memory"] for r in rows[full:])
    assert rows[full - 1]["memory"] != rows[full]["memory"] and summary["memory_flat_from_chunk"] == full
    assert not any(r["storage_moved"] for r in rows[full - 1 :])  # every storage tensor stays where it was
    assert summary["storage_moves_after_flat"] == 0
    assert len({r["clean_latent_bytes"] for r in rows[full:]}) == 1  # the re-cache latents: two chunks, freed as they leave
    assert json.loads((tmp_path / "soak.json").read_text())["runs"] == runs
