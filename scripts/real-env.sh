#!/usr/bin/env bash
# A real engine's environment (kvdiag/real, tests/real, `kvdiag validate --real`):
#   bash scripts/real-env.sh vllm|sglang        build it unless current; print its path
#   bash scripts/real-env.sh --path vllm|sglang print where it is (built or not)
# A virtualenv per engine holding exactly scripts/real/<engine>.txt (every package pinned, all
# installed with --no-deps, so no resolver ever chooses a torch: the CPU build 2.13.0+cpu comes
# from pip's find-links). It lives in a per-user cache outside the clone, keyed by the
# requirements' checksum, so a machine builds each engine once and CI's fresh clones reuse it:
#   ${KVDIAG_REAL_ENVS:-${XDG_CACHE_HOME:-~/.cache}/kvdiag/real-envs}/<engine>-<sha256[:12]>
# A stamp written last marks it complete; a build interrupted before it is started again. Two
# builds of one engine at once wait for each other (flock). kvdiag/real/envs.py finds the same path.
# Sizes: vLLM about 3.5 GB and 4 minutes, SGLang about 2.8 GB and 3-4 minutes (2 cores).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
print_only=0
if [ "${1:-}" = "--path" ]; then print_only=1; shift; fi
engine=${1:?usage: real-env.sh [--path] vllm|sglang}
req="$here/real/$engine.txt"
[ -f "$req" ] || { echo "real-env.sh: no engine '$engine' (no $req)" >&2; exit 2; }
sum=$(sha256sum "$req" | cut -d' ' -f1)
root=${KVDIAG_REAL_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/kvdiag/real-envs}
dest="$root/$engine-${sum:0:12}"
if [ "$print_only" = 1 ]; then echo "$dest"; exit 0; fi
mkdir -p "$root"
exec 9>"$root/$engine.lock"
flock 9
if [ -f "$dest/.stamp" ] && [ "$(cat "$dest/.stamp")" = "$sum" ]; then
  echo "$dest"
  exit 0
fi
echo "real-env.sh: building the $engine environment in $dest (several minutes, GBs)" >&2
rm -rf "$dest"
"${PYTHON:-python3}" -m venv "$dest"
# (pip's notes on the configured local indexes that lack a package are dropped: one per package)
"$dest/bin/python" -m pip install -q --no-deps -r "$req" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; } >&2
# The checks: a CPU torch, and the engine importable as the harness starts it (SGLang through
# the project's import-time stand-ins, kvdiag/real/site).
"$dest/bin/python" - <<'PY' >&2
import torch
assert torch.version.cuda is None, f"a real-engine env must hold the CPU torch, got {torch.__version__}"
PY
case "$engine" in
  vllm) "$dest/bin/python" -c 'import transformers, vllm.entrypoints.openai.api_server' >&2 ;;
  sglang) PYTHONPATH="$here/../kvdiag/real/site:$here/../kvdiag/real/sglang_site" SGLANG_USE_CPU_ENGINE=1 \
      "$dest/bin/python" -c 'import transformers, sglang.launch_server' >&2 ;;
esac
echo "$sum" > "$dest/.stamp"
echo "$dest"
