#!/usr/bin/env bash
# Benchmarks (not tests): each prints its figure next to a baseline measured in
# the same run, as a ratio. Pass --quick for a short smoke run.
set -euo pipefail
source "$(dirname "$0")/env.sh"
quick=""
[ "${1:-}" = "--quick" ] && quick="--quick"
run_example() { # name, title, args...
  local name=$1 title=$2; shift 2
  if [ -f "rust/core/examples/$name.rs" ]; then
    echo "== $title"
    cargo run --release --quiet -p lmcache-rc-core --example "$name" -- "$@"
  fi
}
run_example identity_bench "identity (Rust): token roots vs raw SHA-256"
echo "== identity (Python): TokenRoots.build vs hashlib"
python ci/bench_identity.py
keep=$(mktemp -d)
trap 'rm -rf "$keep"' EXIT
run_example directory_bench "directory: publish / durable marking / find vs raw SQLite" $quick --keep "$keep"
echo "== directory (Python): Directory.find vs the Rust find of the same directory"
python ci/bench_directory.py "$keep" "${CARGO_TARGET_DIR:-target}/release/examples/directory_bench"
run_example l2_bench "L2 tier: durable writes / verified cold reads vs raw file I/O"
echo "== service: store + retrieve through lease slots vs memcpy"
python ci/bench_service.py
run_example rpc_bench "RPC round trip vs raw Unix-socket ping-pong" $quick
run_example transfer_bench "transfer engine (Rust, cpu backend) vs memcpy"
run_example transfer_breakdown "transfer engine: time per phase of a job (lease RPCs, checks, copy, finish) vs memcpy and an RPC round trip" 256
echo "== transfer engine (lmcache-rc bench, cpu backend): store + restore through the sidecar vs memcpy"
python ci/bench_transfer.py
echo "== eviction policies (lmcache-rc trace replay): compute saved by cost-aware eviction vs lru on short synthetic traces (docs/trace.md)"
python -m lmcache_rc trace replay agentic --sessions 12 --sizes 8M:32M
python -m lmcache_rc trace replay chat --sessions 100 --sizes 1M:4M
run_example shared_bench "shared tier (S3, s3s-fs on loopback): upload / verified download vs raw PUT/GET, cross-host lookup" $quick
echo "== skip rule (lmcache-rc restore-skip): shared tier with 50 ms injected latency, short prefixes recomputed, long ones restored"
python -m lmcache_rc restore-skip
if [ -z "$quick" ]; then
  echo "== serving (vLLM's OpenAI server, CPU build): TTFT and prefill tokens of (c) lmcache-rc vs (a) no prefix caching and (b) vLLM's own (ci/bench-serving.sh)"
  bash ci/bench-serving.sh
fi
