"""Writes the connector's option tables in ``docs/vllm.md`` from the options table.

Every option's name, default and meaning is written once, in
``lmcache_rc.vllm.options.OPTIONS``; the two tables of ``docs/vllm.md``
(upstream mode §A.5, boundary mode) are generated between the marker
comments ``<!-- options:<mode>:begin -->`` and ``<!-- options:<mode>:end -->``.
Run ``python ci/gen_option_docs.py`` after changing the table; ``--check``
(run by ``ci/lint.sh``) fails when the docs are out of date.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from lmcache_rc.vllm.options import option_table

TARGET = Path(__file__).resolve().parent.parent / "docs" / "vllm.md"
MODES = ("upstream", "boundary")


def render(text: str) -> str:
    """``text`` with every marked option table regenerated."""
    for mode in MODES:
        begin, end = f"<!-- options:{mode}:begin -->", f"<!-- options:{mode}:end -->"
        pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.DOTALL)
        if len(pattern.findall(text)) != 1:
            raise SystemExit(f"{TARGET}: expected one {begin} ... {end} block")
        before, after = pattern.split(text)
        text = f"{before}{begin}\n{option_table(mode)}{end}{after}"
    return text


def main(argv: list[str]) -> int:
    """Rewrites the tables, or with ``--check`` reports whether they are current."""
    current = TARGET.read_text()
    text = render(current)
    if "--check" in argv:
        if current != text:
            print(
                f"{TARGET}'s option tables are out of date with "
                "lmcache_rc.vllm.options.OPTIONS; run python ci/gen_option_docs.py",
                file=sys.stderr,
            )
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
