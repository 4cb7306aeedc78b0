"""Every notebook is paired with its jupytext .md twin and runs top to bottom on the CPU."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib

import pytest

import attn_jax

jupytext = pytest.importorskip("jupytext", reason="the test extra's jupytext (absent on the GPU machine)")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.md"))


def code_cells(notebook) -> list[str]:
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"]


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no jupytext .md notebook"


def _reuse_the_sessions_hf_smollm2(request, monkeypatch) -> None:
    """transformers' ``from_pretrained(folder, gguf_file=...)`` of the embedded SmolLM2, called as
    conftest's ``hf_smollm2`` calls it (the model in float32), answers with that fixture's result:
    transformers converts the GGUF's vocabulary and weights once per session (about 35 s on the
    CI machine), not again for the notebook. The model is a deep copy, so the notebook's changes
    stay in it; any other call goes to transformers."""
    import copy

    import torch
    import transformers

    gguf = request.getfixturevalue("smollm2_gguf")
    model, tokenizer = request.getfixturevalue("hf_smollm2")

    def answer(cls, value, want: dict):
        original = cls.from_pretrained

        def from_pretrained(name, *args, **kwargs):
            gguf_file = kwargs.pop("gguf_file", None)
            if not args and gguf_file == gguf.name and pathlib.Path(name) == gguf.parent and kwargs == want:
                return value()
            return original(name, *args, gguf_file=gguf_file, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", from_pretrained)

    answer(transformers.AutoTokenizer, lambda: tokenizer, {})
    answer(transformers.AutoModelForCausalLM, lambda: copy.deepcopy(model), {"dtype": torch.float32})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_paired_and_runs(path, capsys, monkeypatch, request):
    monkeypatch.setenv("ATTN_STACK_NOTEBOOK_FAST", "1")  # notebooks that read it run a smaller workload
    if "gguf_file=" in path.read_text():  # transformers on the embedded GGUF: the session's copy
        _reuse_the_sessions_hf_smollm2(request, monkeypatch)
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


def _install_cell(path: pathlib.Path) -> str:
    return code_cells(jupytext.read(path))[0]


SETTINGS = re.compile(r'^(EXTRAS = "[a-z]*"|NEEDS_MODEL = (True|False))  # .*$', re.M)


def test_every_notebook_starts_with_the_same_install_cell():
    """One install cell, differing only in what the notebook needs; its extras exist."""
    cells = {path.stem: _install_cell(path) for path in NOTEBOOKS}
    assert len({SETTINGS.sub("", c) for c in cells.values()}) == 1, "the notebooks' install cells differ"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, cell in cells.items():
        (extras,) = re.findall(r'^EXTRAS = "([a-z]*)"', cell, re.M)
        assert extras == "" or extras in declared, f"{name}: EXTRAS={extras!r} is not an extra of attn-stack"
        assert f'"{extras}": [' in cell, f"{name}: the cell does not know which modules {extras!r} provides"


def _scratch_python(tmp: pathlib.Path) -> pathlib.Path:
    """A fresh venv whose only view of this environment is its third-party packages: attn-stack
    itself (an editable install here) is absent, so the cell has to install it."""
    deps = tmp / "deps"
    deps.mkdir()
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if not entry.name.startswith(("attn_stack", "__editable__", "attn_jax", "attn_torch", "bridge")):
            (deps / entry.name).symlink_to(entry)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (pathlib.Path(purelib) / "deps.pth").write_text(str(deps) + "\n")
    return python


def _checkout_copy(tmp: pathlib.Path) -> pathlib.Path:
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", "build", ".pytest_cache", ".hypothesis"
    )
    return pathlib.Path(shutil.copytree(ROOT, tmp / "attn-stack", ignore=ignore))


def test_install_cell_installs_from_a_checkout_without_a_restart(tmp_path):
    """The pytorch_bridge cell (an extra and the model wheel) in a fresh environment, the
    checkout as its source: attn-stack lands in site-packages and imports in the same process."""
    python = _scratch_python(tmp_path)
    source = _checkout_copy(tmp_path)
    cell = _install_cell(ROOT / "notebooks" / "pytorch_bridge.md")
    script = tmp_path / "cell.py"
    script.write_text(
        cell + "\nimport attn_jax.serving, attn_torch\n"
        "print('IMPORTED', attn_jax.__file__, attn_torch.__file__)\n"
    )  # fmt: skip
    env = os.environ | {"ATTN_STACK_SOURCE": str(source), "PIP_NO_DEPS": "1", "PIP_NO_BUILD_ISOLATION": "0"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [python, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    venv = str(tmp_path / "venv")
    imported = [line for line in result.stdout.splitlines() if line.startswith("IMPORTED")]
    assert imported and all(p.startswith(venv) for p in imported[0].split()[1:]), result.stdout
    assert result.stdout.startswith(f"attn-stack {attn_jax.__version__} from {venv}")


def test_install_cell_names_a_missing_source(tmp_path):
    python = _scratch_python(tmp_path)
    script = tmp_path / "cell.py"
    script.write_text(_install_cell(ROOT / "notebooks" / "ragged_paged_attention.md"))
    env = os.environ | {"ATTN_STACK_SOURCE": str(tmp_path / "nowhere")}
    env.pop("PYTHONPATH", None)
    result = subprocess.run([python, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert f"ATTN_STACK_SOURCE='{tmp_path / 'nowhere'}' does not exist: clone the repository there" in result.stderr
