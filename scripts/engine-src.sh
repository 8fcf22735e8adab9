#!/usr/bin/env bash
# The engines' own KV-pool classes for the differential test (tests/refpool/test_differential.py):
# downloads the vLLM and SGLang wheels the facts were read from and unpacks only the modules
# the test imports. Nothing of them is committed; the folder is ignored by git.
set -euo pipefail
dest=${1:-.cache/engine-src}
py=${PYTHON:-.venv/bin/python}
if [ -f "$dest/vllm/v1/core/block_pool.py" ] && [ -f "$dest/sglang/srt/mem_cache/radix_cache.py" ] \
  && [ -f "$dest/vllm/v1/metrics/loggers.py" ] && [ -f "$dest/sglang/srt/managers/scheduler_components/metrics_reporter.py" ]; then
  exit 0
fi
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$py" -m pip download -q --no-deps vllm==0.33.0 sglang==0.5.23 -d "$wheels"
"$py" - "$wheels" "$dest" <<'PY'
import sys, zipfile
from pathlib import Path
wheels, dest = Path(sys.argv[1]), Path(sys.argv[2])
wanted = ("vllm/v1/core/", "sglang/srt/mem_cache/",
          # the engines' logging code for tests/logs (stats lines, retract warning, log format)
          "vllm/v1/metrics/", "vllm/logger.py", "vllm/envs.py", "vllm/logging_utils/", "vllm/_version.py",
          "vllm/entrypoints/common/startup.py", "sglang/srt/managers/scheduler.py",
          "sglang/srt/managers/scheduler_components/", "sglang/srt/utils/common.py", "sglang/_version.py")
for wheel in wheels.glob("*.whl"):
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(dest, [n for n in zf.namelist() if n.startswith(wanted)])
PY
