"""``ci/check_refs.py`` on small synthetic repositories: each rule finds what
it should (outside references, dangling paths and anchors) and nothing else;
and on this repository, where it must find nothing (``ci/lint.sh`` runs it)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

CHECKER = Path(__file__).resolve().parents[1] / "ci" / "check_refs.py"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_refs", CHECKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_refs", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def repo(tmp_path: Path, files: dict[str, str]) -> Path:
    """A git repository holding ``files`` (all staged, so ``git ls-files`` sees them)."""
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    return tmp_path


def findings(root: Path, *args: str) -> tuple[int, list[str]]:
    out = subprocess.run(
        ["python3", str(CHECKER), "--root", str(root), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.returncode, [line for line in out.stdout.splitlines() if line]


def test_a_clean_tree_passes(tmp_path: Path) -> None:
    root = repo(
        tmp_path,
        {
            "docs/design/a.md": (
                "# A\n\n## Second part\n\nSee [b](b.md#b) and [here](#second-part).\n"
            ),
            "docs/design/b.md": "# B\n",
            "rust/core/src/lib.rs": "//! See `docs/design/a.md` and ``docs/design/b.md`` §2.\n",
        },
    )
    assert findings(root) == (0, [])


def test_outside_references_are_found_once_per_line(tmp_path: Path) -> None:
    root = repo(
        tmp_path,
        {
            "x.py": "\n".join(
                [
                    '"""DESIGN §9 and spec §7.3."""',
                    "# see ../shared/vectors/identity-v1.json",
                    "# spec/identity-and-index.md and storage-and-transfer §5",
                    "# (§2.4) with no document on this line or the two before",
                    "# vllm-boundary-api.md §2.3",
                    "# ``docs/design/vllm-boundary-api.md`` §2.4 is fine",
                    "# DESIGN I6",
                ]
            )
            + "\n",
            "docs/design/vllm-boundary-api.md": "# In repo\n\nSee vllm-boundary-api.md §1.\n",
        },
    )
    code, lines = findings(root, "--rules", "outside")
    assert code == 1
    assert [line.split(":")[1] for line in lines] == ["1", "2", "3", "4", "5", "7"]


def test_dangling_paths_and_anchors_are_found(tmp_path: Path) -> None:
    root = repo(
        tmp_path,
        {
            "docs/a.md": "\n".join(
                [
                    "# A",
                    "[gone](missing.md) [web](https://example.com/x.md) [b](b.md#nope)",
                    "`docs/missing.md` `vllm/v1/core/elsewhere.py` `docs/b.md`",
                    "```",
                    "[in a fence](nowhere.md)",
                    "```",
                ]
            )
            + "\n",
            "docs/b.md": "# B\n",
        },
    )
    code, lines = findings(root)
    assert code == 1
    assert len(lines) == 3, lines
    assert any(":2: paths:" in line and "'missing.md'" in line for line in lines)
    assert any("#nope" in line for line in lines)
    assert any("'docs/missing.md'" in line for line in lines)


def test_slugs_follow_github() -> None:
    checker = load()
    assert checker.slugify("4. Validate the lease (`plan::plan_copy`)") == (
        "4-validate-the-lease-planplan_copy"
    )
    assert checker.slugify("The directory's contract") == "the-directorys-contract"
    anchors = checker.anchors_of("# X\n## Same\n## Same\n```\n# not a heading\n```\n")
    assert {"x", "same", "same-1"} <= anchors
    assert "not-a-heading" not in anchors


def test_this_repository_has_no_outside_or_dangling_references() -> None:
    out = subprocess.run(
        [sys.executable, str(CHECKER)],
        cwd=CHECKER.parents[1],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (out.returncode, out.stdout) == (0, ""), out.stdout + out.stderr


def test_a_relative_reference_to_the_in_repo_boundary_spec_passes(tmp_path: Path) -> None:
    root = repo(
        tmp_path,
        {
            "docs/design/vllm-boundary-api.md": "# Boundary\n",
            "docs/testing.md": "Plays [the vLLM side](design/vllm-boundary-api.md) (§2.3).\n",
            "docs/other.md": "Not `other/vllm-boundary-api.md`.\n",
        },
    )
    code, lines = findings(root, "--rules", "outside")
    assert code == 1
    assert len(lines) == 1 and lines[0].startswith("docs/other.md:1: outside:"), lines


def test_plain_anchored_references_in_code_are_checked(tmp_path: Path) -> None:
    root = repo(
        tmp_path,
        {
            "docs/design/t.md": "# T\n\n## RPC timeout reconciliation\n",
            "rust/core/src/lib.rs": "\n".join(
                [
                    "//! Fine: `docs/design/t.md#rpc-timeout-reconciliation`.",
                    "//! Stale anchor: docs/design/t.md#rpc-timeouts.",
                    "//! Missing file: docs/design/gone.md#anything.",
                    "//! Not a repository path: https://example.com/docs/x.md#y and t.md#z.",
                ]
            )
            + "\n",
            "lmcache_rc/x.py": '"""See docs/design/t.md#rpc-timeout-reconciliation."""\n',
        },
    )
    code, lines = findings(root)
    assert code == 1
    assert lines == [
        "rust/core/src/lib.rs:2: anchors: no heading for anchor #rpc-timeouts in docs/design/t.md",
        "rust/core/src/lib.rs:3: paths: file does not exist: 'docs/design/gone.md'",
    ]


def test_untracked_top_level_directories_do_not_count(tmp_path: Path) -> None:
    # A build directory (ignored, untracked) must neither add findings for
    # paths under it nor hide them: `target/...` is not a repository path.
    root = repo(tmp_path, {"README.md": "Installs into `target/vllm-site/`.\n"})
    (root / "target").mkdir()
    assert findings(root) == (0, [])
    (root / "docs").mkdir()
    (root / "docs" / "a.md").write_text("See `docs/missing.md`.\n", encoding="utf-8")
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    code, lines = findings(root)
    assert code == 1 and lines == ["docs/a.md:1: paths: file does not exist: 'docs/missing.md'"]
