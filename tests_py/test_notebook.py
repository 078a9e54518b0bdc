"""``docs/notebooks/quickstart.ipynb`` is committed executed, with its plot, and still runs.

The committed notebook carries the outputs of a top-to-bottom run (``jupyter
nbconvert --execute --to notebook --inplace``): every code cell ran in order,
none failed, and the plot of restored versus recomputed tokens per turn and
the dedup ratio is embedded as a PNG image; the PNG the notebook saves
(``docs/notebooks/quickstart-restores.png``, linked from the docs) is
committed too. The run test executes the notebook again with nbclient (a
``test`` extra, installed by ci/env.sh) in a scratch directory, so the
committed files are never rewritten by tests.
"""

from __future__ import annotations

import ast
import base64
from pathlib import Path
from typing import Any

import nbclient
import nbformat

NOTEBOOK = Path(__file__).resolve().parents[1] / "docs" / "notebooks" / "quickstart.ipynb"
SAVED_PLOT = NOTEBOOK.with_name("quickstart-restores.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load() -> Any:
    return nbformat.reads(NOTEBOOK.read_text(encoding="utf-8"), as_version=4)


def code_cells(nb: Any) -> list[Any]:
    return [c for c in nb.cells if c.cell_type == "code"]


def images(nb: Any) -> list[bytes]:
    """Every embedded PNG of the notebook's outputs, decoded."""
    return [
        base64.b64decode(out["data"]["image/png"])
        for cell in code_cells(nb)
        for out in cell.outputs
        if "image/png" in out.get("data", {})
    ]


def text_of(nb: Any) -> str:
    parts = []
    for cell in code_cells(nb):
        for out in cell.outputs:
            if out.output_type == "stream":
                parts.append(out.text)
            parts.append(str(out.get("data", {}).get("text/plain", "")))
    return "".join(parts)


def test_notebook_is_committed_with_the_outputs_of_one_clean_run() -> None:
    nb = load()
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert nb.cells[0].cell_type == "markdown"
    ids = [c.get("id") for c in nb.cells]
    assert len(set(ids)) == len(ids)
    cells = code_cells(nb)
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1))
    for cell in cells:
        ast.parse(cell.source)  # every code cell is valid Python
        assert all(out.output_type != "error" for out in cell.outputs), cell.source
    assert "pool_id" in text_of(nb)  # the capabilities of the pool handed over by descriptor
    assert "dedup ratio over the conversation" in text_of(nb)


def test_committed_notebook_embeds_the_restores_plot_and_the_saved_png() -> None:
    nb = load()
    pngs = images(nb)
    assert len(pngs) == 1 and pngs[0].startswith(PNG_MAGIC)
    [plot_cell] = [
        c for c in code_cells(nb) if any("image/png" in o.get("data", {}) for o in c.outputs)
    ]
    assert 'savefig("quickstart-restores.png"' in plot_cell.source
    assert SAVED_PLOT.read_bytes().startswith(PNG_MAGIC)


def test_quickstart_notebook_runs_and_draws_its_plot(tmp_path: Path) -> None:
    nb = load()
    for cell in code_cells(nb):
        cell.outputs, cell.execution_count = [], None
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3")
    client.execute(cwd=str(tmp_path))  # the plot is saved here, not over the committed one
    html = [
        out for cell in code_cells(nb) for out in cell.outputs if "text/html" in out.get("data", {})
    ]
    assert len(html) >= 3  # the two RequestResults and the EngineStatus
    pngs = images(nb)
    assert len(pngs) == 1 and pngs[0].startswith(PNG_MAGIC)
    assert (tmp_path / "quickstart-restores.png").read_bytes().startswith(PNG_MAGIC)
    assert "dedup ratio over the conversation" in text_of(nb)
