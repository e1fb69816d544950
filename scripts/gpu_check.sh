#!/usr/bin/env bash
# Every GPU benchmark and check in one call of the device tool's `run`; results under $OUT.
#
# Here, once:  echo /.whl/ >> .git/info/exclude && bash scripts/fetch_gpu_wheels.sh
# On the GPU:  run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=510)
# On a CPU, as a dry run of the plumbing:  SMALL=1 OUT=/tmp/gpu_dry bash scripts/gpu_check.sh
#
# Budget: the step limits below sum to 450 s, installs included (one call may run 600 s). The benchmarks
# come first and the GPU tests last, so slow compiles cost the tests, not the figures. A step that fails or
# runs out of time is logged and the next one runs. Files (the device returns at most 8): versions.txt,
# steps.log (every step's output), summary.txt (each step's exit status), and one JSON per benchmark.
set -uo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
: >"$OUT/steps.log"
: >"$OUT/summary.txt"
export PYTHONUNBUFFERED=1
small=${SMALL:+--small}

step() {  # name, time limit (s), command...: output appended to steps.log, exit status to summary.txt
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name (limit ${limit} s)" | tee -a "$OUT/steps.log"
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/steps.log"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$OUT/steps.log" "$OUT/summary.txt"
}

# Nothing goes into the image's Python (the device README's way): the carried wheels and this package go into a
# scratch folder put first on PYTHONPATH. The package is laid out as pip installs it (pyproject's package-dir maps
# pipelines/ to diffusers_qvg.pipelines) by copying, which needs no build backend on the image.
site=$(mktemp -d)/site
mkdir -p "$site"
if [ -d .whl ]; then
    step install_wheels 40 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
fi
cp -r diffusers_qvg "$site/" && cp -r pipelines "$site/diffusers_qvg/pipelines"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -P -c "import diffusers, diffusers_qvg.pipelines" 2>&1 | tee -a "$OUT/steps.log"; then
    echo "== install: diffusers_qvg.pipelines does not import from $site; nothing else runs" | tee -a "$OUT/summary.txt"
    exit 1
fi

{
    date -u +%Y-%m-%dT%H:%MZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    python3 -P -c "import sys, torch, triton, diffusers, diffusers_qvg; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'diffusers', diffusers.__version__, 'diffusers_qvg from', diffusers_qvg.__file__)"
} 2>&1 | tee "$OUT/versions.txt"

step bench_kernels 110 python3 scripts/bench_kernels.py $small --json "$OUT/bench_kernels.json"
step bench_attention 80 python3 scripts/bench_attention.py $small --attention dispatch sageattention-1.0.6 --json "$OUT/bench_attention.json"
step bench_e2e 150 python3 scripts/bench_e2e.py $small --json "$OUT/bench_e2e.json"
# -P: the checkout's own diffusers_qvg/ (which lacks pipelines/) must not shadow the laid-out package.
step gpu_tests 70 python3 -P -m pytest -q -m gpu tests -p no:cacheprovider
cat "$OUT/summary.txt"
