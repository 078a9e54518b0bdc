#!/usr/bin/env bash
# The serving benchmark (ci/bench_serving.py): vLLM's OpenAI server on vLLM's
# CPU build with a 251M-parameter hybrid model, (a) without prefix caching,
# (b) with vLLM's own, (c) with lmcache-rc; time to first token, prefill
# tokens, hit rate, throughput and the connector's own cost per request,
# as ratios measured in this run. About 15 minutes on 2 cores (the model is
# written once, about 500 MB, under ~/.cache/lmcache-rc/engine-models).
# Usage: bash ci/bench-serving.sh [--json FILE]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
read -r PY SITE < <(bash "$ROOT/ci/vllm-cpu-env.sh" | tail -n 1)
PYTHONPATH="$SITE" HF_HUB_OFFLINE=1 "$PY" "$ROOT/ci/bench_serving.py" "$@"
