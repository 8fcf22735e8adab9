#!/usr/bin/env bash
# The oracle environment for the scheduler differential tests (tests/refpool/test_oracles.py):
# a separate virtualenv (default .cache/oracle-venv, ignored by git) holding vLLM 0.33.0's and
# SGLang 0.5.23's wheels and the pinned packages their schedulers import
# (scripts/oracle/requirements.txt), all with --no-deps. Idempotent: a stamp holding the
# requirements' checksum skips a rebuild. The main .venv stays light.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:-.cache/oracle-venv}
req="$here/oracle/requirements.txt"
sum=$(sha256sum "$req" | cut -d' ' -f1)
if [ -f "$dest/.stamp" ] && [ "$(cat "$dest/.stamp")" = "$sum" ]; then
  exit 0
fi
rm -rf "$dest"
"${PYTHON:-python3}" -m venv "$dest"
"$dest/bin/python" -m pip install -q --no-deps -r "$req"
"$dest/bin/python" - <<'PY'
import torch
assert torch.version.cuda is None, f"the oracle env must hold the CPU torch, got {torch.__version__}"
PY
echo "$sum" > "$dest/.stamp"
