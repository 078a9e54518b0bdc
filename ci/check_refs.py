#!/usr/bin/env python3
"""Checks that the repository's references stay inside the repository.

The design of lmcache-rc lives in ``docs/design/``; nothing tracked may point
at documents outside the checkout, and no in-repo reference may dangle. This
script scans the tracked text files (``git ls-files``; ``.md .py .rs .pyi .sh
.toml .ipynb``) and reports, as ``file:line: rule: message``:

outside
    a reference to a document outside the repository: ``../shared``,
    ``shared/spec``, ``shared/vectors``, ``DESIGN.md``, ``DESIGN §…``,
    ``DESIGN I<n>``, ``spec/identity-and-index``, ``spec/storage-and-transfer``,
    ``spec/vllm-boundary-api`` and the bare names ``identity-and-index`` and
    ``storage-and-transfer``; ``vllm-boundary-api.md`` unless it is the in-repo
    ``docs/design/vllm-boundary-api.md`` (or a relative reference that resolves
    to it from the file's directory, e.g. ``design/vllm-boundary-api.md`` in
    ``docs/``); "spec §…", "storage §…"; and, in source files (not
    Markdown), a bare section sign ``§<n>`` whose line and the two lines
    before it name no ``.md`` document (it can only mean an outside spec).
paths
    a Markdown link ``[text](path)`` (in ``.md`` and ``.ipynb`` files) whose
    target does not exist, and a backticked repository-relative path (its
    first component is a top-level directory of the repository, e.g.
    ``docs/x.md``, ``rust/core/src/foo.rs``) that does not exist. Top-level
    directories are those holding tracked files, so ignored build output
    (``target/``, ``.venv/``) neither adds nor hides findings.
anchors
    a Markdown link ``path.md#anchor`` or ``#anchor`` whose anchor is not a
    heading of the target (GitHub's heading slugs); and, in every scanned
    file, a plain ``path.md#anchor`` (a code comment's
    ``docs/design/transfers.md#backends``): its path, taken from the
    repository root or else from the file's directory, must exist (a
    ``paths`` finding when its first component is a top-level directory)
    and its anchor must be a heading there.

Usage::

    python3 ci/check_refs.py                 # every rule, whole repository
    python3 ci/check_refs.py --rules outside # one rule (comma-separated list)
    python3 ci/check_refs.py docs/design     # only these files or directories
    python3 ci/check_refs.py --count         # print the number of problems only

Exit status: 0 when nothing was found, 1 when something was (every finding is
listed), 2 on a usage error or when git is unavailable. The checker and its
tests (``tests_py/test_check_refs.py``) are not scanned. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

EXTENSIONS = (".md", ".py", ".rs", ".pyi", ".sh", ".toml", ".ipynb")
RULES = ("outside", "paths", "anchors")
# The checker and its tests spell out the patterns on purpose.
EXCLUDED = ("ci/check_refs.py", "tests_py/test_check_refs.py")
IN_REPO_BOUNDARY_SPEC = "docs/design/vllm-boundary-api.md"

# (compiled pattern, message). Case-sensitive unless marked.
OUTSIDE_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\.\./shared\b"), "path outside the repository (../shared)"),
    (re.compile(r"\bshared/(spec|vectors|DESIGN)"), "reference to the shared design files"),
    (re.compile(r"\bDESIGN\.md\b"), "reference to DESIGN.md (outside the repository)"),
    (re.compile(r"\bDESIGN\s*(§|I\d)"), "reference to DESIGN (outside the repository)"),
    (
        re.compile(r"\bspec/(identity-and-index|storage-and-transfer|vllm-boundary-api)"),
        "reference to an outside spec file",
    ),
    (
        re.compile(r"\b(identity-and-index|storage-and-transfer)\b"),
        "reference to an outside spec document",
    ),
    (re.compile(r"\bspec\b[`'\"*]*\s*§", re.IGNORECASE), "section of an outside spec"),
    (re.compile(r"\bstorage(\s+spec)?\s*§"), "section of the outside storage spec"),
]
BOUNDARY_SPEC = re.compile(r"(?<![\w/.-])(?:[\w./-]*/)?vllm-boundary-api\.md")
BARE_SECTION = re.compile(r"§\s*\d")
# A plain ``some/path.md#anchor`` (not a URL: nothing path-like right before it).
PLAIN_ANCHORED = re.compile(r"(?<![\w./:-])((?:[\w.-]+/)*[\w.-]+\.md)#([A-Za-z0-9_-]+)")
NAMES_A_DOC = re.compile(r"[\w./-]+\.md\b")

MD_LINK = re.compile(
    r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
)
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)")
BACKTICKED = re.compile(r"(`+)([^`\n]+?)\1")
PATH_LIKE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.\-/]*$")
FILE_EXT = re.compile(r"\.[A-Za-z0-9]{1,8}$")


@dataclass(frozen=True)
class Finding:
    """One problem: where, which rule, what."""

    path: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.message}"


def repo_root(start: Path) -> Path:
    """The top of the git work tree containing ``start``."""
    out = subprocess.run(
        ["git", "-C", str(start), "rev-parse", "--show-toplevel"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def tracked_files(root: Path) -> list[str]:
    """Tracked text files with a scanned extension, repository-relative."""
    return sorted(n for n in all_tracked(root) if n.endswith(EXTENSIONS))


def all_tracked(root: Path) -> list[str]:
    """Every tracked path, repository-relative (any extension)."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True
    )
    return [n for n in out.stdout.decode("utf-8", "replace").split("\0") if n]


def existing(root: Path, rel: str) -> bool:
    """Whether ``rel`` (repository-relative, normalised) exists in the work tree."""
    return (root / rel).exists()


def normalise(base_dir: str, target: str) -> str | None:
    """``target`` resolved against ``base_dir`` (both repository-relative);
    None when it climbs out of the repository."""
    joined = target[1:] if target.startswith("/") else os.path.join(base_dir, target)
    norm = os.path.normpath(joined)
    if norm == "." or norm.startswith(".."):
        return None if norm.startswith("..") else ""
    return norm


# --------------------------------------------------------------------------- headings


def slugify(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links → their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(text: str) -> set[str]:
    """Every heading anchor of a Markdown text (duplicates get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fence: str | None = None
    for line in text.splitlines():
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if marker:
            if fence is None:
                fence = marker.group(1)[0]
            elif stripped.startswith(fence * 3):
                fence = None
            continue
        if fence is not None:
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = slugify(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
        out.add(slug)
    return out


# --------------------------------------------------------------------------- rules


def outside_refs(rel: str, lines: list[str]) -> Iterator[Finding]:
    """Rule ``outside``."""
    base = os.path.dirname(rel)
    markdown = rel.endswith((".md", ".ipynb"))
    for no, line in enumerate(lines, 1):
        for pattern, message in OUTSIDE_PATTERNS:
            m = pattern.search(line)
            if m:
                yield Finding(rel, no, "outside", f"{message}: {m.group(0)!r}")
                break
        else:
            for m in BOUNDARY_SPEC.finditer(line):
                token = m.group(0)
                if token.endswith(IN_REPO_BOUNDARY_SPEC) and (
                    token == IN_REPO_BOUNDARY_SPEC or token.endswith("/" + IN_REPO_BOUNDARY_SPEC)
                ):
                    continue
                if normalise(base, token) == IN_REPO_BOUNDARY_SPEC:
                    continue  # a relative reference that resolves to it
                yield Finding(
                    rel,
                    no,
                    "outside",
                    f"{token!r} is not the in-repo {IN_REPO_BOUNDARY_SPEC}",
                )
                break
            else:
                if markdown or not BARE_SECTION.search(line):
                    continue
                context = " ".join(lines[max(0, no - 3) : no])
                if not names_in_repo_doc(context):
                    yield Finding(
                        rel,
                        no,
                        "outside",
                        "section sign without a document: name the docs/design file it means",
                    )


def names_in_repo_doc(text: str) -> bool:
    """Whether ``text`` names a Markdown document other than an outside one."""
    for pattern, _ in OUTSIDE_PATTERNS:
        text = pattern.sub(" ", text)
    for m in NAMES_A_DOC.finditer(text):
        name = m.group(0)
        if name.endswith("vllm-boundary-api.md") and not name.endswith(IN_REPO_BOUNDARY_SPEC):
            continue
        return True
    return False


def markdown_links(line: str) -> Iterable[str]:
    """Link targets of one line (images included)."""
    for m in MD_LINK.finditer(line):
        yield m.group(1)
    for m in IMAGE_LINK.finditer(line):
        yield m.group(1)


def is_external(target: str) -> bool:
    """Whether a link target is a URL (any scheme) rather than a path."""
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target)) or target.startswith("//")


def link_refs(
    root: Path, rel: str, lines: list[str], rules: set[str], anchor_cache: dict[str, set[str]]
) -> Iterator[Finding]:
    """Rules ``paths`` and ``anchors`` for Markdown links."""
    base = os.path.dirname(rel)
    fence: str | None = None
    for no, line in enumerate(lines, 1):
        stripped = line.lstrip()
        if rel.endswith(".md"):
            marker = re.match(r"(`{3,}|~{3,})", stripped)
            if marker:
                if fence is None:
                    fence = marker.group(1)[0]
                elif stripped.startswith(fence * 3):
                    fence = None
                continue
            if fence is not None:
                continue
        for target in markdown_links(line):
            if is_external(target):
                continue
            path_part, _, anchor = target.partition("#")
            path_part = path_part.split("?", 1)[0]
            if path_part:
                resolved = normalise(base, path_part)
                if resolved is None:
                    if "paths" in rules:
                        yield Finding(rel, no, "paths", f"link leaves the repository: {target!r}")
                    continue
                if not existing(root, resolved):
                    if "paths" in rules:
                        yield Finding(rel, no, "paths", f"link target does not exist: {target!r}")
                    continue
            else:
                resolved = rel
            if anchor and "anchors" in rules and resolved.endswith(".md"):
                if resolved not in anchor_cache:
                    try:
                        text = (root / resolved).read_text(encoding="utf-8")
                    except OSError:
                        text = ""
                    anchor_cache[resolved] = anchors_of(text)
                if anchor.lower() not in anchor_cache[resolved]:
                    yield Finding(
                        rel, no, "anchors", f"no heading for anchor #{anchor} in {resolved}"
                    )


def backticked_paths(
    root: Path, rel: str, lines: list[str], top_dirs: set[str]
) -> Iterator[Finding]:
    """Rule ``paths`` for backticked repository-relative paths."""
    for no, line in enumerate(lines, 1):
        for m in BACKTICKED.finditer(line):
            text = m.group(2).strip()
            text = re.split(r"::|#|:\d", text, maxsplit=1)[0].rstrip(".,;:")
            if "/" not in text or not PATH_LIKE.match(text):
                continue
            first = text.split("/", 1)[0]
            if first not in top_dirs:
                continue
            looks_like_dir = text.endswith("/")
            if not looks_like_dir and not FILE_EXT.search(text.rsplit("/", 1)[-1]):
                continue
            if not existing(root, os.path.normpath(text)):
                what = "directory" if looks_like_dir else "file"
                yield Finding(rel, no, "paths", f"{what} does not exist: {text!r}")


def plain_anchored_refs(
    root: Path,
    rel: str,
    lines: list[str],
    rules: set[str],
    top_dirs: set[str],
    anchor_cache: dict[str, set[str]],
) -> Iterator[Finding]:
    """Rule ``anchors`` (and ``paths``) for plain ``path.md#anchor`` text.

    Markdown links are left to :func:`link_refs`; this covers code comments,
    docstrings and prose that name a heading of an in-repo document."""
    base = os.path.dirname(rel)
    markdown = rel.endswith((".md", ".ipynb"))
    for no, line in enumerate(lines, 1):
        for m in PLAIN_ANCHORED.finditer(line):
            if markdown and line[: m.start()].endswith("]("):
                continue  # a Markdown link's target: link_refs checks it
            path_part, anchor = m.group(1), m.group(2)
            candidates = [normalise("", path_part), normalise(base, path_part)]
            resolved = next((c for c in candidates if c and existing(root, c)), None)
            if resolved is None:
                if "paths" in rules and path_part.split("/", 1)[0] in top_dirs:
                    yield Finding(rel, no, "paths", f"file does not exist: {path_part!r}")
                continue
            if "anchors" not in rules:
                continue
            if resolved not in anchor_cache:
                try:
                    text = (root / resolved).read_text(encoding="utf-8")
                except OSError:
                    text = ""
                anchor_cache[resolved] = anchors_of(text)
            if anchor.lower() not in anchor_cache[resolved]:
                yield Finding(rel, no, "anchors", f"no heading for anchor #{anchor} in {resolved}")


def tracked_top_dirs(files: Iterable[str]) -> set[str]:
    """Top-level directories that hold tracked files."""
    return {f.split("/", 1)[0] for f in files if "/" in f}


def check_file(
    root: Path,
    rel: str,
    rules: set[str],
    top_dirs: set[str],
    anchor_cache: dict[str, set[str]],
) -> list[Finding]:
    """Every finding of the selected rules in one file, in line order."""
    try:
        text = (root / rel).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    lines = text.splitlines()
    found: list[Finding] = []
    if "outside" in rules:
        found.extend(outside_refs(rel, lines))
    if rel.endswith((".md", ".ipynb")) and rules & {"paths", "anchors"}:
        found.extend(link_refs(root, rel, lines, rules, anchor_cache))
    if "paths" in rules:
        found.extend(backticked_paths(root, rel, lines, top_dirs))
    if rules & {"paths", "anchors"}:
        found.extend(plain_anchored_refs(root, rel, lines, rules, top_dirs, anchor_cache))
    # One finding per (line, rule, message).
    unique = {(f.line, f.rule, f.message): f for f in found}
    return sorted(unique.values(), key=lambda f: (f.line, f.rule, f.message))


def main(argv: list[str] | None = None) -> int:
    """Runs the checks; returns the exit status (0 clean, 1 findings, 2 error)."""
    parser = argparse.ArgumentParser(
        description="Fail on references outside the repository and dangling in-repo paths."
    )
    parser.add_argument("only", nargs="*", help="restrict to these files or directories")
    parser.add_argument(
        "--rules",
        default=",".join(RULES),
        help=f"comma-separated subset of {', '.join(RULES)} (default: all)",
    )
    parser.add_argument("--root", help="repository root (default: the git top level of .)")
    parser.add_argument("--count", action="store_true", help="print only the number of problems")
    args = parser.parse_args(argv)

    rules = {r.strip() for r in args.rules.split(",") if r.strip()}
    unknown = rules - set(RULES)
    if unknown or not rules:
        parser.error(f"unknown rule(s) {sorted(unknown)}; choose from {', '.join(RULES)}")
    try:
        root = repo_root(Path(args.root or "."))
        files = tracked_files(root)
        everything = all_tracked(root)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"check_refs: cannot list tracked files with git: {e}", file=sys.stderr)
        return 2
    if args.only:
        wanted = [os.path.normpath(os.path.relpath(Path(p).resolve(), root)) for p in args.only]
        files = [
            f for f in files if any(f == w or f.startswith(w.rstrip("/") + "/") for w in wanted)
        ]
    files = [f for f in files if f not in EXCLUDED]
    top_dirs = tracked_top_dirs(everything)

    findings: list[Finding] = []
    anchor_cache: dict[str, set[str]] = {}
    for rel in files:
        findings.extend(check_file(root, rel, rules, top_dirs, anchor_cache))

    if args.count:
        print(len(findings))
    else:
        for f in findings:
            print(f)
        if findings:
            nfiles = len({f.path for f in findings})
            print(f"check_refs: {len(findings)} problem(s) in {nfiles} file(s)", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
