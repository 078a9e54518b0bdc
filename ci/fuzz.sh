#!/usr/bin/env bash
# Fuzzes the RPC frame/message decoders (not part of CI by default).
#
# cargo-fuzz needs a nightly toolchain, which this project's machines cannot
# install; until one is available this runs the decoder property tests
# (arbitrary bytes must decode or fail with a Protocol error, never panic;
# decode(encode(x)) == x for every message) with many more cases.
# Usage: ci/fuzz.sh [CASES]   (default 200000)
set -euo pipefail
cd "$(dirname "$0")/.."
cases="${1:-200000}"
echo "== decoder property fuzzing: $cases cases per property"
PROPTEST_CASES="$cases" cargo test --release -p lmcache-rc-core --test integration -- rpc_wire:: --quiet
