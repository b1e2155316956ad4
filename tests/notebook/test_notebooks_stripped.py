"""Notebooks are committed without outputs: no outputs, no execution counts, no saved widget state.

Strip one with ``jupyter nbconvert --clear-output --inplace notebooks/NAME.ipynb`` (and drop
``metadata.widgets`` if JupyterLab saved widget state)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from tests.support.paths import REPO, TESTS

NOTEBOOKS = sorted([*(REPO / "notebooks").glob("*.ipynb"), *(TESTS / "notebooks").glob("*.ipynb")])


def test_the_notebooks_exist() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "clients.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stripped(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code
    assert [i for i, cell in enumerate(code) if cell.outputs] == [], "outputs committed"
    assert [i for i, cell in enumerate(code) if cell.execution_count is not None] == [], "execution counts committed"
    assert "widgets" not in notebook.metadata, "widget state committed"
    assert not [i for i, cell in enumerate(notebook.cells) if "execution" in cell.metadata], "timings committed"
