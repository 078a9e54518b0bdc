#!/usr/bin/env bash
# The README's main-job command: set up .venv, build, and run `lmcache-rc demo`
# (an embedded sidecar, a 2-rank simulated hybrid engine in separate
# processes, multi-turn restores verified byte-for-byte, a restart restoring
# from disk). Extra arguments go to the demo, e.g. `bash ci/demo.sh --json`.
set -euo pipefail
source "$(dirname "$0")/env.sh"
lmcache-rc demo "$@"
