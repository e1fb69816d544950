"""qvg-generate: the embedded random model writes playable MP4s; prompts files split across processes."""

import os
import subprocess
import sys
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest

from diffusers_qvg.cli import main

REPO = Path(__file__).resolve().parents[2]


def read_video(path) -> np.ndarray:
    with imageio.get_reader(path, "ffmpeg") as reader:
        return np.stack([frame for frame in reader])  # list(reader) trusts len() = inf


def test_embedded_default_writes_a_playable_mp4(tmp_path, capsys):
    out = tmp_path / "fox.mp4"
    main(["a fox in the snow", "--num-frames", "33", "--output", str(out)])
    frames = read_video(out)
    assert frames.shape == (33, 160, 160, 3) and frames.dtype == np.uint8
    assert frames.std() > 0  # real pixels, not an empty stream
    printed = capsys.readouterr().out
    assert "RANDOM weights" in printed and "--model self_forcing_dmd.pt --base" in printed
    row = next(line for line in printed.splitlines() if line.startswith("fox.mp4"))
    chunks, kv, bf16, ratio = row.split()[1:5]
    assert int(chunks) == 3 and float(ratio) == pytest.approx(float(bf16) / float(kv), rel=2e-2)


def test_keep_recent_chunks_reaches_the_cache(tmp_path):
    with pytest.raises(ValueError, match="keep_recent_chunks=-1 is invalid"):
        main(["a fox", "--num-frames", "9", "--height", "32", "--width", "32", "--keep-recent-chunks", "-1",
              "--output", str(tmp_path / "fox.mp4")])
    assert not (tmp_path / "fox.mp4").exists()


def test_checkpoint_model_needs_a_base(tmp_path):
    ckpt = tmp_path / "model.pt"
    ckpt.write_bytes(b"")
    with pytest.raises(SystemExit, match="needs --base"):
        main(["a fox", "--model", str(ckpt)])
    with pytest.raises(SystemExit, match="exactly one"):
        main(["--num-frames", "9"])


def test_prompts_file_split_across_two_processes(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red boat\n\na blue car\na green tree\n")
    out = tmp_path / "videos"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "scripts" / "generate.py"), "--prompts-file", str(prompts), "--num-frames", "9",
         "--kv-cache", "bf16", "--height", "32", "--width", "32", "--output", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["0000-rank0-a-red-boat.mp4", "0001-rank0-a-blue-car.mp4", "0002-rank1-a-green-tree.mp4"]
    for name in names:
        assert read_video(out / name).shape == (9, 32, 32, 3)
    assert "[rank 0] wrote" in result.stdout and "[rank 1] wrote" in result.stdout
