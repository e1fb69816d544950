"""The codec benchmark: it runs end to end at small sizes, and its measures mean what they say."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import diffusers_qvg as dq
from diffusers_qvg.codec_quality import attention_probe, measure_codec, query_sample
from diffusers_qvg.video_kv import VideoKVSpec, video_kv

ROOT = Path(__file__).resolve().parents[1]
TINY = VideoKVSpec(height=32, width=48, patch=8, heads=2, head_dim=16)


def test_reference_format_measures_exactly_zero_error_at_16_bits():
    data = video_kv(TINY, chunks=2)
    r = measure_codec(dq.BF16Config(), data, attention_probe(data, queries=16))
    assert r.bits_per_element == 16.0
    errors = (r.key_rel_l2, r.key_pre_rope_rel_l2, r.value_rel_l2, r.attention_error, r.sharp_attention_error)
    assert errors == (0.0,) * 5
    assert (r.attention_error_pre_rope, r.sharp_attention_error_pre_rope) == (0.0, 0.0)
    assert r.quantize_ms > 0 and r.dequantize_ms > 0


def test_queries_come_from_the_last_chunk():
    data = video_kv(TINY, chunks=2)
    q = query_sample(data, 4)
    last = data.query[:, data.chunk(1)]
    assert q.shape == (1, 4, 2, 16)
    assert torch.equal(q[:, 0], last[:, 0]) and torch.equal(q[:, -1], last[:, -1])


ROWS = ("bf16", "qvg-int2", "rtn-int2", "kivi-int2", "qvg-int2 warm start")  # every kind of row, in seconds


def test_small_run_prints_the_table():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_codec.py"), "--small", "--only", *ROWS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| codec | bits/elem")
    names = [row.split("|")[1].strip() for row in rows[1:]]
    assert names == list(ROWS)
    bf16 = rows[1 + names.index("bf16")].split("|")
    assert bf16[2].strip() == "16.000" and bf16[4].strip() == "0.0000"


def test_unknown_row_names_the_choices():
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_codec.py"), "--small", "--only", "nope"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode != 0 and "unknown codec rows ['nope']" in run.stderr and "qvg-int2" in run.stderr


def test_qvg_beats_rtn_and_kivi_at_equal_or_fewer_bits_on_video_data():
    """At a quarter of Self-Forcing's frame (1170-token chunks, head_dim 128) with centroids scaled to match
    (64 per 1170 tokens, as 256 per 4680), QVG INT2 costs no more bits than RTN INT2 (2.25) and KIVI INT2 and errs less
    on K, V and both attention errors."""
    spec = VideoKVSpec(height=240, width=416, heads=2, head_dim=128)
    data = video_kv(spec, chunks=2)
    probe = attention_probe(data, queries=64)
    qvg = measure_codec(dq.QVGConfig(num_centroids=64), data, probe)
    for baseline in ("rtn-int2", "kivi-int2"):
        other = measure_codec(dq.resolve_codec(baseline), data, probe)
        assert qvg.bits_per_element <= other.bits_per_element + 0.01, baseline  # equal up to per-head scalars
        for field in ("key_rel_l2", "value_rel_l2", "attention_error", "sharp_attention_error"):
            assert getattr(qvg, field) < getattr(other, field), (baseline, field)


def test_keeping_recent_chunks_exact_lowers_the_attention_error_and_is_checked():
    data = video_kv(TINY, chunks=3)
    probe = attention_probe(data, queries=16)
    codec = dq.QVGConfig(num_centroids=8, group_size=16)
    errors = [measure_codec(codec, data, probe, keep_recent=k).attention_error for k in (0, 1, 2)]
    assert errors[0] > errors[1] > errors[2] == 0.0  # with every older chunk exact, attention is exact
    with pytest.raises(ValueError, match="keep_recent=3"):
        measure_codec(codec, data, probe, keep_recent=3)
