"""``ci/check_modules.py`` on small synthetic crates: a circle between
modules and an import up a floor are each reported with the file that makes
them, imports inside one module are not; and on this repository, where it
must find nothing (``ci/lint.sh`` runs it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

CHECKER = Path(__file__).resolve().parents[1] / "ci" / "check_modules.py"

FLOORS = """# Architecture

### Module floors

| floor | modules | what |
|---|---|---|
| 0 | `error` | errors |
| 1 | `low` | below |
| 2 | `high`, `side` | above |

### Next
"""


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_modules", CHECKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(
    tmp_path: Path,
    files: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> tuple[int, str]:
    checker = load()
    src = tmp_path / "src"
    for name, text in {"lib.rs": "pub use error::Error;\n", "error.rs": "", **files}.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    doc = tmp_path / "architecture.md"
    doc.write_text(FLOORS)
    monkeypatch.setattr(checker, "SRC", src)
    monkeypatch.setattr(checker, "DOC", doc)
    monkeypatch.setattr(checker, "ROOT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["check_modules.py"])
    code = checker.main()
    return code, capsys.readouterr().out


def test_imports_down_the_floors_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run(
        tmp_path,
        {
            "low.rs": "use crate::Error;\n",
            "high/mod.rs": "mod inner;\nuse crate::{low::x, error::Error};\n",
            "high/inner.rs": "use super::y; // crate::side::z in a comment\n",
            "side.rs": 'use crate::high::y; const S: &str = "crate::low";\n',
        },
        monkeypatch,
        capsys,
    )
    assert code == 0, out
    assert "no circle, none upward" in out


def test_an_import_up_a_floor_is_reported_with_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run(
        tmp_path,
        {"low.rs": "fn f() { crate::high::g() }\n", "high.rs": "", "side.rs": ""},
        monkeypatch,
        capsys,
    )
    assert code == 1
    assert "upward import low (floor 1) -> high (floor 2): src/low.rs" in out


def test_a_circle_on_one_floor_is_reported_with_its_edges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run(
        tmp_path,
        {
            "low.rs": "",
            "high.rs": "use crate::side::{a, b::c};\n",
            "side/mod.rs": "mod d;\n",
            "side/d.rs": "use crate::high::H;\n",
        },
        monkeypatch,
        capsys,
    )
    assert code == 1
    assert "module circle high side" in out
    assert "high -> side (src/high.rs)" in out and "side -> high (src/side/d.rs)" in out


def test_a_module_missing_from_the_table_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run(
        tmp_path, {"low.rs": "", "high.rs": "", "side.rs": "", "new.rs": ""}, monkeypatch, capsys
    )
    assert code == 1
    assert "module new is missing from the floor table" in out


def test_this_repository_has_no_circle_and_no_upward_import() -> None:
    out = subprocess.run(
        [sys.executable, str(CHECKER)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
