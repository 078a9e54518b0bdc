"""``docs/notebooks/quickstart.ipynb`` is valid nbformat 4 and runs top to bottom.

With ``nbclient`` (and a Jupyter kernel) installed the notebook is executed by
nbclient; otherwise its code cells are executed in order with ``exec`` in one
namespace, and the value of each cell's last expression is rendered through
``_repr_html_`` when it has one — so this test always runs the notebook's code.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from typing import Any

NOTEBOOK = Path(__file__).resolve().parents[1] / "docs" / "notebooks" / "quickstart.ipynb"


def load() -> dict[str, Any]:
    nb: dict[str, Any] = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    return nb


def source(cell: dict[str, Any]) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else str(src)


def test_notebook_is_plain_nbformat_4_without_outputs() -> None:
    nb = load()
    assert nb["nbformat"] == 4 and nb["nbformat_minor"] >= 4
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    kinds = [c["cell_type"] for c in nb["cells"]]
    assert kinds[0] == "markdown" and "code" in kinds
    ids = [c.get("id") for c in nb["cells"]]
    assert len(set(ids)) == len(ids)
    for cell in nb["cells"]:
        assert cell["cell_type"] in ("markdown", "code")
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None
            ast.parse(source(cell))  # every code cell is valid Python
    if importlib.util.find_spec("nbformat") is not None:
        nbformat = importlib.import_module("nbformat")
        nbformat.validate(nbformat.reads(NOTEBOOK.read_text(encoding="utf-8"), as_version=4))


def _nbclient_usable() -> bool:
    return (
        importlib.util.find_spec("nbclient") is not None
        and importlib.util.find_spec("nbformat") is not None
        and importlib.util.find_spec("ipykernel") is not None
    )


def _run_with_nbclient() -> None:
    nbclient = importlib.import_module("nbclient")
    nbformat = importlib.import_module("nbformat")
    nb = nbformat.reads(NOTEBOOK.read_text(encoding="utf-8"), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3")
    client.execute(cwd=str(NOTEBOOK.parents[2]))  # the repository root
    html = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if "text/html" in out.get("data", {})
    ]
    assert len(html) >= 3  # the two RequestResults and the EngineStatus


def _run_with_exec() -> None:
    namespace: dict[str, Any] = {"__name__": "__quickstart__"}
    rendered = 0
    try:
        for i, cell in enumerate(c for c in load()["cells"] if c["cell_type"] == "code"):
            tree = ast.parse(source(cell), filename=f"<cell {i}>")
            last: ast.expr | None = None
            tail = tree.body[-1] if tree.body else None
            if isinstance(tail, ast.Expr):
                tree.body.pop()
                last = tail.value
            exec(compile(tree, f"<cell {i}>", "exec"), namespace)
            if last is not None:
                value = eval(compile(ast.Expression(last), f"<cell {i}>", "eval"), namespace)
                to_html = getattr(value, "_repr_html_", None)
                if to_html is not None:
                    html = to_html()
                    assert isinstance(html, str) and "<table>" in html
                    rendered += 1
                else:
                    repr(value)
    finally:  # a failing cell must not leak the sidecar or the engines
        for name in ("producer", "consumer"):
            engine = namespace.get(name)
            if engine is not None:
                engine.close()
        server = namespace.get("server")
        if server is not None and not server.stopped:
            server.stop()
    assert rendered >= 3  # the two RequestResults and the EngineStatus
    assert namespace["server"].stopped
    assert namespace["second"].restored_tokens > 0
    assert not Path(namespace["workdir"]).exists()


def test_quickstart_notebook_runs() -> None:
    if _nbclient_usable():
        _run_with_nbclient()
    else:
        _run_with_exec()
