#!/usr/bin/env bash
# Every GPU check and benchmark in one call (the device tool's `run`), results under $OUT.
#
# Here, once:  echo /.whl/ >> .git/info/exclude && bash scripts/fetch_gpu_wheels.sh
# On the GPU:  run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=420)
# On a CPU, as a dry run of the plumbing:  SMALL=1 OUT=/tmp/gpu_dry bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
small=${SMALL:+--small}

if [ -d .whl ]; then  # the GPU machine has torch, triton, accelerate, transformers, but not these
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1

{
    date -u +%Y-%m-%dT%H:%MZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    python3 -c "import sys, torch, triton, diffusers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'diffusers', diffusers.__version__)"
} | tee "$OUT/versions.txt"

step() {  # name, time limit (s), command...: log to $OUT/name.log, keep going on failure
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
}

step gpu_tests 150 python3 -m pytest -q -m gpu tests -p no:cacheprovider
step bench_kernels 120 python3 scripts/bench_kernels.py $small --json "$OUT/bench_kernels.json"
step bench_attention 90 python3 scripts/bench_attention.py $small --json "$OUT/bench_attention.json"
step bench_e2e 150 python3 scripts/bench_e2e.py $small --json "$OUT/bench_e2e.json"
cat "$OUT/summary.txt"
