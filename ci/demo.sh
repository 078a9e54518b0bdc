#!/usr/bin/env bash
# The README's main-job command: set up .venv, build, and run the main job.
# Until `lmcache-rc demo` exists this prints the version and the checkpoint
# identity of a sample prompt.
set -euo pipefail
source "$(dirname "$0")/env.sh"
lmcache-rc --version
lmcache-rc identity
