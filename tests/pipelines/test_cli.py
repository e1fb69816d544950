"""qvg-generate: the embedded random model writes playable MP4s; the prompt as an argument or a flag; prompts
files split across processes; every parser refuses abbreviations."""

import ast
import os
import re
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
    assert "[rank" not in printed and f"wrote {out}" in printed  # one process: no rank tags
    row = next(line for line in printed.splitlines() if line.startswith("fox.mp4"))
    chunks, kv, bf16, ratio = row.split()[1:5]
    assert int(chunks) == 3 and float(ratio) == pytest.approx(float(bf16) / float(kv), rel=2e-2)


def test_keep_recent_chunks_reaches_the_cache(tmp_path):
    with pytest.raises(ValueError, match="keep_recent_chunks=-1 is invalid"):
        main(["a fox", "--num-frames", "9", "--height", "32", "--width", "32", "--keep-recent-chunks", "-1",
              "--output", str(tmp_path / "fox.mp4")])
    assert not (tmp_path / "fox.mp4").exists()


TINY = ["--num-frames", "9", "--height", "32", "--width", "32", "--kv-cache", "bf16"]


def test_prompt_flag_is_the_prompt_not_an_abbreviation(tmp_path, capsys):
    flag, positional = tmp_path / "flag.mp4", tmp_path / "positional.mp4"
    main(["--prompt", "a fox", *TINY, "--output", str(flag)])
    main(["a fox", *TINY, "--output", str(positional)])
    assert np.array_equal(read_video(flag), read_video(positional))  # the same prompt, the same seed
    with pytest.raises(SystemExit, match=r"given twice \('a fox' and --prompt 'a cat'\); give it once"):
        main(["a fox", "--prompt", "a cat", *TINY, "--output", str(tmp_path / "twice.mp4")])
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # `--prompts` is not taken for `--prompts-file`
        main(["--prompts", "prompts.txt", *TINY])
    assert refused.value.code == 2 and "unrecognized arguments: --prompts" in capsys.readouterr().err
    assert not (tmp_path / "twice.mp4").exists()


def test_help_ends_with_three_examples(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    examples = capsys.readouterr().out.rstrip().split("\nexamples:\n")[1]
    commands = [line.strip() for line in examples.splitlines() if re.match(r"  [^ #]", line)]  # not comments, not continuations
    assert commands == [
        'qvg-generate "a fox running through snow" --output fox.mp4',
        'qvg-generate --prompt "a corgi surfing a wave at sunset" --model checkpoints/self_forcing_dmd.pt \\',
        "accelerate launch --num_processes 8 -m diffusers_qvg.cli --prompts-file prompts.txt \\",
    ]
    assert "--base Wan2.1-T2V-1.3B-Diffusers" in examples.split("accelerate launch")[1]


def test_prompt_flag_in_a_subprocess(tmp_path):
    """The command of a new user, as a separate process (``python -m diffusers_qvg.cli``, the module form
    ``accelerate launch -m`` runs)."""
    out = tmp_path / "fox.mp4"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "diffusers_qvg.cli", "--prompt", "a fox", *TINY, "--output", str(out)],
                            env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_video(out).shape == (9, 32, 32, 3)
    assert f"wrote {out}" in result.stdout and "[rank" not in result.stdout


def argument_parsers(path: Path) -> list[ast.Call]:
    calls = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)]
    return [c for c in calls if getattr(c.func, "attr", getattr(c.func, "id", None)) == "ArgumentParser"]


def test_every_parser_refuses_abbreviations():
    files = [*(REPO / "diffusers_qvg").rglob("*.py"), *(REPO / "pipelines").rglob("*.py"), *(REPO / "scripts").glob("*.py")]
    parsers = {f.relative_to(REPO).as_posix(): argument_parsers(f) for f in files}
    parsers = {name: calls for name, calls in parsers.items() if calls}
    assert "diffusers_qvg/cli.py" in parsers and "scripts/bench_e2e.py" in parsers
    for name, calls in parsers.items():
        for call in calls:
            options = {k.arg: k.value for k in call.keywords}
            assert isinstance(options.get("allow_abbrev"), ast.Constant) and options["allow_abbrev"].value is False, name


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


def test_ulysses_needs_a_launcher_and_no_compile(tmp_path):
    """``--ulysses N`` runs under torchrun (tests/test_ulysses.py runs it there); alone it says how to launch."""
    out = tmp_path / "fox.mp4"
    with pytest.raises(RuntimeError, match="launch with `torchrun --nproc-per-node M`"):
        main(["a fox", *TINY, "--ulysses", "2", "--output", str(out)])
    with pytest.raises(SystemExit, match="--compile does not work with --ulysses yet"):
        main(["a fox", *TINY, "--ulysses", "2", "--compile", "--output", str(out)])
    assert not out.exists()


def test_compile_flag_compiles_the_transformer_and_writes_the_same_video(tmp_path, monkeypatch):
    """``--compile`` reaches ``compile_transformer`` with its mode (the backend forced to aot_eager here: the
    CPU's inductor takes minutes); the video is the uncompiled one's."""
    import numpy as np
    import torch
    from diffusers.utils import export_to_video

    from diffusers_qvg.pipelines import QVGCausalWanPipeline

    calls, frames = [], {}
    real = QVGCausalWanPipeline.compile_transformer

    def compile_on_aot_eager(self, **kwargs):
        calls.append(kwargs)
        real(self, **{**kwargs, "mode": None, "backend": "aot_eager"})

    def keep_frames(video, path, fps):
        frames[path] = np.asarray(video)
        export_to_video(video, path, fps=fps)

    monkeypatch.setattr(QVGCausalWanPipeline, "compile_transformer", compile_on_aot_eager)
    monkeypatch.setattr("diffusers.utils.export_to_video", keep_frames)  # the CLI imports it at call time
    torch._dynamo.reset()
    plain, compiled = str(tmp_path / "plain.mp4"), str(tmp_path / "compiled.mp4")
    main(["a fox", *TINY, "--output", plain])
    main(["a fox", *TINY, "--compile", "reduce-overhead", "--output", compiled])
    torch._dynamo.reset()
    assert calls == [{"mode": "reduce-overhead"}]
    assert (tmp_path / "compiled.mp4").stat().st_size > 0
    assert np.array_equal(frames[plain], frames[compiled])
