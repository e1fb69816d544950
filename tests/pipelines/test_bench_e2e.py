"""scripts/bench_e2e.py runs at small size on the CPU and reports, in one table, the plain BF16 anchor
(rotated keys), the BF16 cache with keys before RoPE, and QVG (the pipeline's keep_recent_chunks 0, and 1)."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_e2e.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_e2e_small(tmp_path, capsys):
    # "int3" is no storage: its rows record the failure, and the rows after them still run.
    rows = load().main(["--small", "--storages", "bf16", "int3", "qvg-int2", "--json", str(tmp_path / "rows.json")])
    failed = [r for r in rows if r["error"] is not None]
    assert [(r["storage"], r["keep_recent_chunks"]) for r in failed] == [("int3", 0), ("int3", 1)]
    assert failed[0]["error"].startswith("ValueError: unknown KV cache storage 'int3'")
    rows = [r for r in rows if r["error"] is None]
    settings = [(r["storage"], r["keys_before_rope"], r["keep_recent_chunks"], r["latent_frames"], r["chunks"])
                for r in rows]
    assert settings == [("bf16", False, 0, 9, 3), ("bf16", True, 0, 9, 3), ("qvg-int2", True, 0, 9, 3),
                        ("qvg-int2", True, 1, 9, 3)]
    plain, bf16, qvg_packed, qvg = rows
    assert qvg["bf16_bytes"] == qvg_packed["bf16_bytes"] == bf16["bf16_bytes"] == plain["bf16_bytes"] > 0
    # The plain cache holds its window in place, the current chunk included (Self-Forcing's cache); the one
    # with keys before RoPE holds the finished chunks and decodes them into a shared window workspace.
    assert plain["kv_bytes"] == bf16["kv_bytes"] * 4 // 3 and plain["total_bytes"] < bf16["total_bytes"]
    assert 0 < qvg_packed["kv_bytes"] < qvg["kv_bytes"] < bf16["kv_bytes"]
    assert all(r["seconds_per_chunk"] > 0 and r["peak_bytes"] is None for r in rows)
    assert len(json.loads((tmp_path / "rows.json").read_text())) == 6
    table = capsys.readouterr().out
    assert "| 9 | no | bf16 | rotated | 0 |" in table and "| 9 | no | bf16 | before RoPE | 0 |" in table
    assert "| 9 | no | qvg-int2 | before RoPE | 1 |" in table and "| 9 | no | qvg-int2 | before RoPE | 0 |" in table
    assert "| 9 | no | int3 | before RoPE | 0 | failed: ValueError: unknown KV cache storage 'int3'" in table
    assert "| 1.000x | +0.0% |" in table and "| anchor |" in table and ">= 6.5x" in table
    # The CPU runs nothing on a device: no breakdown by kernel family, and the table says so.
    assert all(r["last_chunk_device"] is None for r in rows) and "(no CUDA: no device times by kernel family)" in table


def test_device_lines_split_the_last_chunk_by_family_against_the_anchor():
    bench = load()

    def row(storage, keys_before_rope, read_us, encoder_us, other_us):
        families = {"qvg window read": read_us, "qvg encoder": encoder_us, "other": other_us}
        device = {f: dict(us=us, launches=int(us > 0)) for f, us in families.items()}
        device["total"] = dict(us=sum(families.values()), launches=sum(d["launches"] for d in device.values()))
        return dict(storage=storage, keys_before_rope=keys_before_rope, keep_recent_chunks=0, compiled=False,
                    latent_frames=21, error=None, last_chunk_device=device)

    lines = bench.device_lines([row("bf16", False, 0, 0, 480_000), row("qvg-int2", True, 7_500, 2_900, 480_100)])
    assert lines[0].startswith("| latent frames | compiled | storage | keys stored | recent chunks | qvg window read ms")
    assert lines[2] == "| 21 | no | bf16 | rotated | 0 | 0.000 (0) | 0.000 (0) | 480.000 (1) | 480.000 (1) | +0 us |"
    assert lines[3] == ("| 21 | no | qvg-int2 | before RoPE | 0 | 7.500 (1) | 2.900 (1) | 480.100 (1) | 490.500 (3) "
                        "| +10500 us |")
    assert bench.device_lines([dict(row("bf16", False, 0, 0, 1), last_chunk_device=None)]) == []


def test_bench_e2e_small_compiled_rows(capsys):
    """``--compile``: every setting again on the compiled transformer, against the compiled plain anchor (the
    two BF16 settings here: each compiled setting costs its own graphs)."""
    import torch

    torch._dynamo.reset()
    rows = load().main(["--small", "--storages", "bf16", "--compile"])
    torch._dynamo.reset()
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows]
    assert [(r["storage"], r["keys_before_rope"], r["compiled"]) for r in rows] == [
        ("bf16", False, False), ("bf16", True, False), ("bf16", False, True), ("bf16", True, True),
    ]
    eager, compiled = rows[:2], rows[2:]
    assert [r["kv_bytes"] for r in eager] == [r["kv_bytes"] for r in compiled]  # the same caches
    table = capsys.readouterr().out
    assert "| 9 | yes | bf16 | rotated | 0 |" in table
    # Each anchor (eager, compiled) is its own 1.000x, and the compiled setting is timed against the compiled
    # anchor. (Counting "1.000x" lines instead failed when another row happened to time equal.)
    lines = table.splitlines()
    anchors = [line for line in lines if "| bf16 | rotated |" in line]
    assert len(anchors) == 2 and all("| 1.000x | +0.0% |" in line for line in anchors), anchors
    against = compiled[1]["seconds_per_chunk"] / compiled[0]["seconds_per_chunk"]
    assert any(line.startswith("| 9 | yes | bf16 | before RoPE |") and f"| {against:.3f}x |" in line for line in lines)


def test_rotated_keys_add_longlive_2_s_setting_for_the_storages_named():
    bench = load()
    assert bench.settings_for(["bf16", "nvfp4", "qvg-int2"], [0, 1], ["nvfp4"]) == [
        ("bf16", False, 0), ("bf16", True, 0),
        ("nvfp4", True, 0), ("nvfp4", True, 1), ("nvfp4", False, 0), ("nvfp4", False, 1),  # before RoPE, then after
        ("qvg-int2", True, 0), ("qvg-int2", True, 1),
    ]
    rows = bench.main(["--small", "--storages", "nvfp4", "--rotated-keys", "nvfp4", "--keep-recent-chunks", "0"])
    assert [(r["storage"], r["keys_before_rope"], r["error"]) for r in rows] == [("nvfp4", True, None), ("nvfp4", False, None)]
    assert rows[0]["kv_bytes"] == rows[1]["kv_bytes"] > 0  # the same packed bytes, keys rotated or not


def test_attention_backend_runs_every_row_and_an_unusable_one_fails_before_any(capsys, tmp_path, monkeypatch):
    import pytest

    from diffusers_qvg.attention import cached

    seen = []

    def recording(*args, backend=None, **kwargs):
        seen.append(getattr(backend, "value", backend))
        return dispatch(*args, backend=backend, **kwargs)

    dispatch = cached.dispatch_attention_fn
    monkeypatch.setattr(cached, "dispatch_attention_fn", recording)
    bench = load()
    out = tmp_path / "rows.json"
    rows = bench.main(["--small", "--storages", "bf16", "qvg-int2", "--keep-recent-chunks", "0",
                       "--attention-backend", "native", "--json", str(out)])
    assert [r["error"] for r in rows] == [None, None, None]
    assert seen and set(seen) == {"native"}  # every cached self-attention of every row, the anchor's too
    assert {r["attention_backend"] for r in json.loads(out.read_text())} == {"native"}
    assert "attention backend native;" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="sageattention"):  # diffusers names the package to install
        bench.main(["--small", "--storages", "bf16", "--attention-backend", "_sage_qk_int8_pv_fp8_cuda_sm90"])
