#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks (Python 3.12, x86-64) into .whl/ for `carry`.
# imageio-ffmpeg (68 MB) does not fit the carry limit: video_kv decodes with the machine's OpenCV instead.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl \
    diffusers==0.42.1 flash-kmeans==0.3.1 scikit-video==1.1.11 importlib-metadata \
    quant-videogen==0.1.0 termcolor loguru
du -sh .whl
