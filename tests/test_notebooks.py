"""Every notebook is paired with its jupytext .md twin and runs top to bottom on the CPU."""

import pathlib

import jupytext
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.md"))


def code_cells(notebook) -> list[str]:
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"]


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no jupytext .md notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_paired_and_runs(path, capsys, monkeypatch):
    monkeypatch.setenv("ATTN_STACK_NOTEBOOK_FAST", "1")  # notebooks that read it run a smaller workload
    notebook = jupytext.read(path)
    paired = path.with_suffix(".ipynb")
    assert paired.exists(), f"{paired.name} is missing: run `jupytext --sync {path.name}`"
    assert code_cells(jupytext.read(paired)) == code_cells(notebook), (
        f"{paired.name} and {path.name} differ: run `jupytext --sync {path.name}`"
    )
    namespace: dict = {"__name__": "__notebook__"}
    for i, source in enumerate(code_cells(notebook)):
        exec(compile(source, f"{path.name}[cell {i}]", "exec"), namespace)
    assert "Traceback" not in capsys.readouterr().out
