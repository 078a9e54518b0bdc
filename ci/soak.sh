#!/usr/bin/env bash
# Soak benchmark (not run in CI): one sidecar with a small L1, an L2 that
# evicts and a durable index; N worker processes x M minutes of seeded
# store/restore/find, an operator clearing about once a minute, and a SIGKILL
# of a random worker every 20-40 s. Fails on any error, any wrong byte, a
# lease not given back, or RSS/fds/threads of the sidecar growing between the
# middle and the end of the run (the rule is in ci/soak.py's header).
#
#   bash ci/soak.sh [--workers N] [--minutes M] [--seed S] [--keep]
#   bash ci/soak.sh --quick        # a 1-minute smoke
set -euo pipefail
source "$(dirname "$0")/env.sh"
exec python "$(dirname "$0")/soak.py" "$@"
