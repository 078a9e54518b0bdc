#!/usr/bin/env bash
# The real-vLLM suite: tests_vllm/ in the virtualenv of ci/vllm-env.sh, where
# the connector runs under vLLM 0.33's own scheduler (see tests_vllm/harness.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
read -r PY SITE < <(bash "$ROOT/ci/vllm-env.sh" | tail -n 1)
# From inside tests_vllm/ (its own pytest root, no package) the source tree's
# lmcache_rc/ is not on sys.path: the wheel installed in $SITE is what runs.
cd "$ROOT/tests_vllm"
echo "== pytest tests_vllm (vLLM 0.33.0's scheduler on CPU, lmcache-rc wheel)"
PYTHONPATH="$SITE" HF_HUB_OFFLINE=1 "$PY" -m pytest -q -p no:cacheprovider "$@"
