#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU and torch (no Rust needed there).
#
# Build the wheel where Rust is (it is abi3: one build installs on Python >= 3.11):
#     bash ci/gpu-check.sh --build        # -> target/wheels/lmcache_rc-*.whl
# then on the GPU machine, from a checkout that carries target/wheels:
#     bash ci/gpu-check.sh
# It installs the wheel into a throw-away folder put on PYTHONPATH in front of
# the interpreter's own packages (torch, numpy), runs the gpu-marked tests (GPU -> SHM -> GPU
# round trip byte-exact for a 2-D pool and for region pages over several
# tensors with copies in parallel, producer-event ordering, a failed copy
# reported False, bandwidth against torch pinned-memory copies) and prints
# the ratios; then the restore measurement (tests_py/gpu_restore.py): a
# 32K-token TP4 checkpoint, 505 MB, restored from the sidecar's L1 into device
# memory by four cuda engines at once, timed end to end, against raw
# cuMemcpyHtoDAsync of the same bytes (target: ratio >= 0.8; printed with
# its verdict, not a failure). The same measurement runs on the fake driver
# in the test suite (tests_py/fake_cuda_cases.py), at a small size.
# Bounded to 5 + 3 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--build" ]; then
  source ci/env.sh
  maturin build --release --out target/wheels
  ls -l target/wheels/
  exit 0
fi

PY=${PYTHON:-python3}
wheel=$(ls -t target/wheels/lmcache_rc-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  echo "no wheel in target/wheels: run 'bash ci/gpu-check.sh --build' where Rust is installed" >&2
  exit 2
fi
"$PY" - <<'PYCHECK'
import sys
try:
    import torch, numpy
except ImportError as e:
    sys.exit(f"gpu-check needs torch and numpy installed: {e}")
if not torch.cuda.is_available():
    sys.exit("gpu-check: torch sees no CUDA device")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
      f"Python {sys.version.split()[0]}")
PYCHECK

# The wheel goes into a throw-away folder on PYTHONPATH, in front of what
# the interpreter has (a venv with --system-site-packages would not see the
# packages of an interpreter that is itself a venv, as torch images often are).
site=$(mktemp -d)/site
"$PY" -m pip install --quiet --no-deps --no-index --target "$site" "$wheel"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
cd tests_py  # import the installed wheel, not the source tree
"$PY" -c "import lmcache_rc, sys; assert '$site' in lmcache_rc.__file__, lmcache_rc.__file__"
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 300 "$PY" -m pytest test_gpu_transfer.py -m gpu -q -s -p no:cacheprovider \
    -o addopts="" --rootdir=. --noconftest
else
  echo "(pytest not installed: running the gpu tests as a script)"
  timeout 300 "$PY" test_gpu_transfer.py
fi
echo "== restore of a 505 MB TP4 checkpoint from L1 into device memory vs raw cuMemcpyHtoDAsync"
timeout 180 "$PY" gpu_restore.py
