"""Transfer-engine benchmark (cpu backend): ``lmcache-rc bench`` with its
defaults: 256 MiB of 256 KiB pages stored and restored through a real
sidecar with 1 and 2 copy threads, against raw copies of the same bytes in the
same run (targets: >= 0.85 x a one-thread memcpy with 1 copy thread, >= 0.9 x
two raw threads, or one where faster, with 2; see
docs/design/README.md#performance-targets)."""

from __future__ import annotations

import sys

from lmcache_rc.bench import main

if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 256))
