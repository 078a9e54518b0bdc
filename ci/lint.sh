#!/usr/bin/env bash
# Lint everything: references that leave the repository or dangle (check_refs),
# the core's module floors (check_modules: no circle, no upward import),
# Rust formatting and clippy, Python ruff and mypy --strict, and the _native.pyi
# stubs against the built extension. Fails on any finding.
set -euo pipefail
source "$(dirname "$0")/env.sh"
echo "== references stay inside the repository (ci/check_refs.py)"
python ci/check_refs.py
echo "== core modules import down their floors (ci/check_modules.py)"
python ci/check_modules.py
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== ruff"
ruff check lmcache_rc tests_py tests_vllm tests_engine ci
ruff format --check lmcache_rc tests_py tests_vllm tests_engine ci
echo "== mypy --strict"
mypy --strict lmcache_rc
echo "== lmcache_rc/errors.py is generated from the core's error table"
python ci/gen_errors.py --check
echo "== docs/vllm.md's option tables are generated from the connector's options table"
python ci/gen_option_docs.py --check
echo "== stubtest (lmcache_rc/_native.pyi vs the built module)"
python -m mypy.stubtest lmcache_rc._native --allowlist ci/stubtest-allowlist.txt
echo "lint: clean"
