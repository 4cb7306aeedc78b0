"""The documentation site builds with `mkdocs build --strict` (a broken link, a missing anchor
or an unresolvable API reference fails), its generated performance page holds the
kernel workloads, and the README stays a front page."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml")]
    proc = subprocess.run(
        [*command, "-d", str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for page in ("index.html", "performance/index.html", "reference/attn_jax/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    reference = (tmp_path / "site" / "reference" / "attn_jax" / "index.html").read_text()
    assert 'id="attn_jax.Attention"' in reference, "the API reference lost attn_jax.Attention"


def test_performance_page_from_results():
    spec = importlib.util.spec_from_file_location("performance_page", ROOT / "scripts" / "performance_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = module.render()
    assert page.startswith("# Performance\n")
    for workload in ("D1", "D2", "M1", "P1"):
        assert f"| **{workload}** |" in page, workload
    assert "attention_fa3_" in page  # each row names its source file


def test_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 160, "README.md is the front page: keep it under 160 lines, the rest in docs/"
    for command in ("scripts/run.sh", "scripts/test.sh"):
        assert command in readme and (ROOT / command).is_file(), command
    for target in ("docs/getting-started.md", "docs/performance.md", "BENCHMARKS.md", "ARCHITECTURE.md"):
        assert f"]({target}" in readme and (ROOT / target).is_file(), target


def test_every_python_block_compiles():
    """The README's and the docs' Python blocks are valid Python (the README's JAX and PyTorch
    examples also run: tests/test_readme.py)."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)):
            compile(block, f"{path.relative_to(ROOT)} block {i}", "exec")


def test_named_files_exist():
    """Files the docs name in backticks (notebooks, scripts, benchmarks) are in the tree."""
    named = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        named |= set(re.findall(r"`((?:notebooks|scripts|benchmarks)/[\w./-]+\.(?:md|py|sh))`", path.read_text()))
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, f"the docs name files that do not exist: {missing}"
