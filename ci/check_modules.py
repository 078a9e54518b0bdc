"""Check that the core crate's modules import one way: down the floors.

Reads every `crate::…` path in `rust/core/src` (use declarations and inline
paths, comments and string literals removed), maps each file to its top-level
module (a file `<name>.rs` or a folder `<name>/` of the source root is module
<name>; the crate
root's `pub use` re-exports are resolved to the module they come from) and
builds the module graph. It fails when

- two top-level modules import each other, directly or round a circle, or
- a module imports one on a higher floor than its own, or one missing from
  the floor table,

where the floors are the table under "Module floors" in
`docs/architecture.md` (a module may use modules on its own floor's lower
floors, and on its own floor only where the graph stays acyclic). Imports
inside one top-level module (its `mod.rs` and its submodules) are not
checked: they are one module's business. Every offending edge is printed with
the files that make it.

`--files` also prints the strongly connected components of the file-level
graph (each `crate::`, `super::` or `self::` path resolved to the deepest
file it names, and each `mod x;` to its file), to find circles before they
are broken; circles inside one module are its own business.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "rust" / "core" / "src"
DOC = ROOT / "docs" / "architecture.md"

_STRING = re.compile(r'r#*"(?:.|\n)*?"#*|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])\'')
_LINE_COMMENT = re.compile(r"//[^\n]*")
_BLOCK_COMMENT = re.compile(r"/\*(?:.|\n)*?\*/")
_CRATE_PATH = re.compile(r"\bcrate::")
_MOD_DECL = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", re.MULTILINE)
_SUPER_PATH = re.compile(r"(?<![\w:])((?:super::)+|self::)")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ROOT_REEXPORT = re.compile(r"pub use (\w+)::(\{[^}]*\}|\w+);")


def strip(text: str) -> str:
    """Return `text` without comments and string literals (kept as `""`)."""
    text = _BLOCK_COMMENT.sub(" ", text)
    out: list[str] = []
    for line in text.split("\n"):
        line = _STRING.sub('""', line)
        out.append(_LINE_COMMENT.sub("", line))
    return "\n".join(out)


def top_module(path: Path) -> str:
    """The top-level module a source file belongs to (`lib` for the root)."""
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".rs")


def crate_paths(text: str) -> list[list[str]]:
    """Every `crate::a::b…` path in `text`, brace groups expanded."""
    paths: list[list[str]] = []
    for m in _CRATE_PATH.finditer(text):
        paths.extend(_expand(text, m.end(), []))
    return paths


def _expand(text: str, pos: int, prefix: list[str]) -> list[list[str]]:
    """Paths starting at `pos` (just after a `::`), under `prefix`."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos < len(text) and text[pos] == "{":
        out: list[list[str]] = []
        depth, start, i = 0, pos + 1, pos
        while i < len(text):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    out.extend(_group(text[start:i], prefix))
                    break
            i += 1
        return out
    path = list(prefix)
    while True:
        m = _IDENT.match(text, pos)
        if not m:
            break
        path.append(m.group())
        pos = m.end()
        if text.startswith("::", pos):
            pos += 2
            if pos < len(text) and text[pos] == "{":
                return _expand(text, pos, path)
            continue
        break
    return [path] if path else []


def _group(body: str, prefix: list[str]) -> list[list[str]]:
    """Split a brace group's body at its top-level commas and expand each."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(body):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    items.append(body[start:])
    out: list[list[str]] = []
    for item in items:
        item = item.strip()
        if item:
            out.extend(_expand(item, 0, prefix))
    return out


def root_reexports() -> dict[str, str]:
    """Names the crate root re-exports, mapped to their module."""
    found: dict[str, str] = {}
    for m in _ROOT_REEXPORT.finditer(strip((SRC / "lib.rs").read_text())):
        module, names = m.group(1), m.group(2)
        for name in _IDENT.findall(names.strip("{}")):
            if name not in ("self", "as"):
                found[name] = module
    return found


def modules() -> set[str]:
    """The crate's top-level modules (files and folders under src/)."""
    out = {p.stem for p in SRC.glob("*.rs")} | {p.name for p in SRC.iterdir() if p.is_dir()}
    out.discard("lib")
    return out


def module_edges() -> dict[tuple[str, str], set[str]]:
    """(from, to) → the files whose `crate::` paths make that edge."""
    mods, reexports = modules(), root_reexports()
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for path in sorted(SRC.rglob("*.rs")):
        src = top_module(path)
        if src == "lib":
            continue
        for p in crate_paths(strip(path.read_text())):
            head = p[0] if p else ""
            dst = head if head in mods else reexports.get(head)
            if dst is None or dst == src or dst == "macros":
                continue
            edges[(src, dst)].add(str(path.relative_to(ROOT)))
    return edges


def floors() -> list[list[str]]:
    """The floor table of docs/architecture.md, lowest floor first."""
    text = DOC.read_text()
    start = text.find("### Module floors")
    if start < 0:
        sys.exit("check_modules: docs/architecture.md has no '### Module floors' section")
    out: list[list[str]] = []
    for line in text[start:].split("\n")[1:]:
        if line.startswith("#"):
            break
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            out.append(re.findall(r"`(\w+)`", m.group(2)))
    if not out:
        sys.exit("check_modules: the '### Module floors' table is empty")
    return out


def cycles(nodes: set[str], edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    succ: dict[str, list[str]] = defaultdict(list)
    for a, b in sorted(edges):
        succ[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def file_graph() -> tuple[set[str], set[tuple[str, str]]]:
    """File-level graph: each `crate::` path to the deepest file it names."""
    nodes: set[str] = set()
    edges: set[tuple[str, str]] = set()
    reexports = root_reexports()

    def resolve(p: list[str]) -> Path | None:
        if p and p[0] in reexports:
            p = [reexports[p[0]], *p[1:]]
        for n in range(len(p), 0, -1):
            base = SRC.joinpath(*p[:n])
            for cand in (base.with_suffix(".rs"), base / "mod.rs"):
                if cand.is_file():
                    return cand
        return None

    for path in sorted(SRC.rglob("*.rs")):
        rel = str(path.relative_to(SRC))
        nodes.add(rel)
        text = strip(path.read_text())
        here = list(path.relative_to(SRC).with_suffix("").parts)
        if here[-1] in ("mod", "lib"):
            here.pop()
        paths = crate_paths(text)
        for m in _SUPER_PATH.finditer(text):
            ups = m.group(1).count("super")
            base = here[: len(here) - ups] if ups else here
            paths.extend(_expand(text, m.end(), list(base)))
        for m in _MOD_DECL.finditer(text):
            paths.append([*here, m.group(1)])
        for p in paths:
            dst = resolve(p)
            if dst is not None and dst != path:
                edges.add((rel, str(dst.relative_to(SRC))))
    return nodes, edges


def main() -> int:
    """Print offending edges; exit 1 when there is one."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", action="store_true", help="also print file-level circles")
    args = ap.parse_args()
    if args.files:
        nodes, fedges = file_graph()
        for comp in cycles(nodes, fedges):
            print(f"file circle ({len(comp)} files): {' '.join(comp)}")
    edges = module_edges()
    table = floors()
    floor_of = {m: i for i, row in enumerate(table) for m in row}
    bad: list[str] = []
    for m in sorted(modules() - floor_of.keys()):
        bad.append(f"module {m} is missing from the floor table in docs/architecture.md")
    for (a, b), files in sorted(edges.items()):
        if a in floor_of and b in floor_of and floor_of[b] > floor_of[a]:
            bad.append(
                f"upward import {a} (floor {floor_of[a]}) -> {b} (floor {floor_of[b]}): "
                + ", ".join(sorted(files))
            )
    for comp in cycles(modules(), set(edges)):
        inner = [
            f"{a} -> {b} ({', '.join(sorted(f))})"
            for (a, b), f in sorted(edges.items())
            if a in comp and b in comp
        ]
        bad.append(f"module circle {' '.join(comp)}:\n    " + "\n    ".join(inner))
    for line in bad:
        print(f"check_modules: {line}")
    if bad:
        return 1
    print(f"check_modules: {len(modules())} modules, {len(edges)} edges, no circle, none upward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
