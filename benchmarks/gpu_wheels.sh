#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py's trl stage needs on the device image, which has torch 2.11,
# transformers 5.17, accelerate, peft, pyarrow, pandas, xxhash, fsspec and huggingface_hub but not
# TRL or datasets: TRL 1.16 and datasets 5.2 (the versions the bench extra was tested with here)
# and the two packages datasets imports that the image lacks (dill, multiprocess), for Python 3.12
# on x86-64, into .whl/ (git-ignored; about 1.8 MB). r1fit itself needs
# none of them; torch 2.11 with transformers 5.17 runs r1fit (checked on CPU by
# benchmarks/device_versions.sh), so no transformers wheel is carried.
#
#   bash benchmarks/gpu_wheels.sh          # here, with pip and internet, from the repository root
#
# then, on the device (the command at the top of benchmarks/gpu_check.py; the call carries .whl):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; ...
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl trl==1.16.0 datasets==5.2.0 dill==0.4.0 multiprocess==0.70.18
ls -l .whl
du -sh .whl
