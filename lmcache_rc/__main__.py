"""``python -m lmcache_rc``: the same CLI as ``lmcache-rc``."""

import sys

from lmcache_rc.cli import main

sys.exit(main())
