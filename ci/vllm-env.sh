#!/usr/bin/env bash
# Makes (or reuses) the virtualenv of the real-vLLM suite: vllm==0.33.0 from
# PyPI (it brings torch: about 9.5 GB and several minutes the first time,
# cached under ~/.cache/lmcache-rc/ afterwards), and installs this project's
# wheel, built from the working tree, into target/vllm-site/ of this checkout
# (never into the shared venv, so checkouts do not disturb each other).
# Prints the venv's python and the wheel's site directory on its last line.
# Usage: bash ci/vllm-env.sh          (LMCACHE_RC_VLLM_VENV overrides the location)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VLLM_VERSION=0.33.0
VENV="${LMCACHE_RC_VLLM_VENV:-$HOME/.cache/lmcache-rc/vllm-$VLLM_VERSION}"
STAMP="$VENV/.lmcache-rc-vllm"
WANT="vllm==$VLLM_VERSION pytest>=8"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "== creating $VENV: $WANT from PyPI (about 9.5 GB and several minutes the first time; cached afterwards)" >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install --progress-bar off $WANT >&2
  echo "$WANT" > "$STAMP"
fi
"$VENV/bin/python" - <<'PY' >&2
import vllm, torch
assert vllm.__version__ == "0.33.0", vllm.__version__
print(f"== vLLM {vllm.__version__}, torch {torch.__version__}")
PY
# This project's wheel (release build, abi3), installed without touching vLLM's dependencies.
source "$ROOT/ci/env.sh" >&2
WHEELS="$ROOT/target/vllm-wheel"
SITE="$ROOT/target/vllm-site"
rm -rf "$WHEELS" "$SITE"
echo "== building the lmcache-rc wheel for the vLLM venv" >&2
maturin build --release --quiet --out "$WHEELS" >&2
"$VENV/bin/python" -m pip install -q --no-deps --target "$SITE" "$WHEELS"/lmcache_rc-*.whl >&2
echo "$VENV/bin/python $SITE"
