#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks (Python 3.12, x86-64) into .whl/ for `carry`.
# imageio-ffmpeg (68 MB) does not fit the carry limit: video_kv decodes with the machine's OpenCV instead.
# Every other requirement of these wheels is on the image (the device tool's KINDS.md lists its packages): diffusers needs filelock,
# huggingface-hub >= 1.32, numpy, regex, requests, safetensors >= 0.8, Pillow (its importlib_metadata is the
# stdlib's on Python >= 3.8, so that wheel, which needs lazy-importer, is not fetched); flash-kmeans torch, triton,
# tqdm; scikit-video numpy, pillow, scipy; quant-videogen (installed with --no-deps, only compared against, its
# failures caught) einops, accelerate, and termcolor and loguru, fetched here; sageattention 1.0.6 (pure Python
# and Triton, bench_attention's 8-bit rows) nothing beyond torch and triton.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl  # one version of each wheel: two of one package stop the whole install there
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl \
    diffusers==0.42.1 flash-kmeans==0.3.1 scikit-video==1.1.11 \
    quant-videogen==0.1.0 termcolor loguru sageattention==1.0.6
du -sh .whl
