# Sourced by the ci/*.sh scripts: creates .venv if needed and installs the
# package (release build of the extension) plus the test and lint tools.
# Idempotent; safe to source repeatedly. Uses only PyPI and crates.io.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
export PYO3_PYTHON="$ROOT/.venv/bin/python"
stamp=.venv/.lmcache-rc-tools
want="maturin>=1.7,<2 pytest>=8 hypothesis>=6.100 prometheus-client>=0.20 ruff>=0.6 mypy>=1.11 numpy>=2.0 nbconvert>=7 nbclient>=0.10 nbformat>=5.10 ipykernel>=6.29 matplotlib>=3.8 aiohttp>=3.9"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "== installing tools: $want"
  python -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  python -m pip install -q $want
  echo "$want" > "$stamp"
fi
if ! command -v cargo >/dev/null; then
  echo "error: cargo not found; install Rust (>= 1.89) first, e.g. from https://rustup.rs" >&2
  exit 1
fi
# Sourced by several scripts in one run (ci/test.sh runs ci/lint.sh): build once.
if [ "${LMCACHE_RC_BUILT:-}" != "$ROOT" ]; then
  echo "== building lmcache_rc (maturin develop --release; cargo prints its progress)"
  # cargo's own progress and warnings go to the terminal; the first build
  # compiles every dependency (SQLite included) and takes a few minutes.
  maturin develop --release
  python -c "import lmcache_rc" || { echo "error: lmcache_rc failed to import after build" >&2; exit 1; }
  export LMCACHE_RC_BUILT="$ROOT"
fi
