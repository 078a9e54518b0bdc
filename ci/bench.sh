#!/usr/bin/env bash
# Benchmarks (not tests): each prints its figure next to a baseline measured in
# the same run, as a ratio. Pass --quick for a short smoke run.
set -euo pipefail
source "$(dirname "$0")/env.sh"
quick=""
[ "${1:-}" = "--quick" ] && quick="--quick"
echo "== identity (Rust): token roots vs raw SHA-256"
cargo run --release --quiet -p lmcache-rc-core --example identity_bench
echo "== identity (Python): TokenRoots.build vs hashlib"
python ci/bench_identity.py
if [ -f rust/core/examples/directory_bench.rs ]; then
  echo "== directory: find / publish vs raw SQLite"
  cargo run --release --quiet -p lmcache-rc-core --example directory_bench -- $quick
fi
