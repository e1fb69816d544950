"""The one-call GPU script fits the device tool: step limits well inside one 600 s call, benchmarks before the
tests, at most 8 result files, installs into a scratch folder only, no wheel whose requirement is missing.
(Its plumbing runs end to end on a CPU: ``SMALL=1 OUT=/tmp/gpu_dry bash scripts/gpu_check.sh``, in
docs/benchmarks.md.)"""

import re
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
CHECK = (SCRIPTS / "gpu_check.sh").read_text()
CODE = "\n".join(line for line in CHECK.splitlines() if not line.lstrip().startswith("#"))


def steps() -> list[tuple[str, int]]:
    return [(name, int(limit)) for name, limit in re.findall(r"^\s*step (\w+) (\d+) ", CODE, flags=re.M)]


def test_step_limits_fit_one_call_with_the_benchmarks_first():
    names = [name for name, _ in steps()]
    assert names == ["install_wheels", "bench_kernels", "bench_attention", "bench_e2e", "gpu_tests"]
    assert sum(limit for _, limit in steps()) <= 450  # of the 600 s one call may run
    timeout_s = int(re.search(r"timeout_s=(\d+)", CHECK).group(1))  # what the header tells the caller
    assert sum(limit for _, limit in steps()) + 30 <= timeout_s <= 600


def test_at_most_eight_result_files():
    files = set(re.findall(r'\$OUT/([\w.]+)', CODE))
    assert files == {"steps.log", "summary.txt", "versions.txt", "bench_kernels.json", "bench_attention.json",
                     "bench_e2e.json"}
    assert len(files) <= 8


def test_installs_go_to_a_scratch_folder_on_pythonpath():
    pip = [line for line in CODE.splitlines() if "pip install" in line]
    assert len(pip) == 1 and "--no-index --no-deps" in pip[0] and '--target "$site"' in pip[0]
    assert " -e " not in CODE and 'export PYTHONPATH="$site' in CODE


def test_no_wheel_whose_requirement_is_missing_on_the_device():
    """Each wheel's requirements are on the image or fetched beside it (fetch_gpu_wheels.sh says which);
    importlib-metadata needs lazy-importer, which is neither, and diffusers uses the stdlib's on Python 3.12."""
    fetch = (SCRIPTS / "fetch_gpu_wheels.sh").read_text()
    names = fetch.split("-d .whl")[1].split("du -sh")[0].replace("\\", " ").split()
    assert names == ["diffusers==0.42.1", "flash-kmeans==0.3.1", "scikit-video==1.1.11", "quant-videogen==0.1.0",
                     "termcolor", "loguru", "sageattention==1.0.6"]
