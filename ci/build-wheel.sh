#!/usr/bin/env bash
# Builds the installable wheel: abi3 (one wheel for CPython >= 3.11), manylinux,
# release, stripped of debug info (pyproject.toml's `strip = true`, which `pip install .`
# gets too; --strip here says so again). Fails when the extension is over 15 MB.
# Writes dist/lmcache_rc-*.whl and prints its path.
# Install it into any environment, vLLM's included: pip install dist/lmcache_rc-*.whl
set -euo pipefail
source "$(dirname "$0")/env.sh"
rm -rf dist
maturin build --release --strip --out dist >&2
wheel=$(ls dist/lmcache_rc-*.whl)
python - "$wheel" <<'PY' >&2
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    so = [i for i in z.infolist() if i.filename.endswith(".so")]
    size = sum(i.file_size for i in so)
    print(f"== {sys.argv[1]}: {size / 2**20:.1f} MiB extension")
    if size > 15_000_000:
        sys.exit(f"the extension is {size} bytes, over 15 MB: is it stripped?")
PY
echo "$wheel"
