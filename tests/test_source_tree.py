"""Rules of the house that hold for the source tree as a whole."""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPS = ROOT / "attn_jax" / "ops"
ENV_ACCESS = re.compile(r"\bos\.environ\b|\bgetenv\b|^\s*import os\b|^\s*from os import", re.M)


@pytest.mark.parametrize("path", sorted(OPS.rglob("*.py")), ids=lambda p: str(p.relative_to(OPS)))
def test_kernels_are_pure(path):
    """Nothing under ops/ reads environment variables (ARCHITECTURE.md, rules of the house)."""
    assert not ENV_ACCESS.search(path.read_text()), f"{path.relative_to(ROOT)} reads the environment"


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency: install attn-stack[test]"
    result = subprocess.run([ruff, "check", "--output-format", "concise", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


UPWARD_IMPORT = re.compile(
    r"^\s*(from|import)\s+attn_jax\.(backends|selector|layer|registry|testing|serving|models|cli)\b", re.M
)


@pytest.mark.parametrize("path", sorted(OPS.rglob("*.py")), ids=lambda p: str(p.relative_to(OPS)))
def test_ops_do_not_import_upward(path):
    """ops/ sits below backends, selection, layers and test helpers: no arrow points up."""
    match = UPWARD_IMPORT.search(path.read_text())
    assert match is None, f"{path.relative_to(ROOT)} imports {match.group(0).strip()!r}"


BRIDGE = ROOT / "bridge"
IMPORTS_ATTN_TORCH = re.compile(r"^\s*(from|import)\s+attn_torch\b", re.M)


@pytest.mark.parametrize("path", sorted(BRIDGE.rglob("*.py")), ids=lambda p: str(p.relative_to(BRIDGE)))
def test_bridge_does_not_import_attn_torch(path):
    """bridge/ is the torch side's ground floor (DLPack, JAX's memory policy): attn_torch
    builds on it, never the other way round (the torchax path lives in attn_torch/torchax.py)."""
    match = IMPORTS_ATTN_TORCH.search(path.read_text())
    assert match is None, f"{path.relative_to(ROOT)} imports {match.group(0).strip()!r}"


def test_bridge_holds_only_dlpack_and_memory_policy():
    assert sorted(p.name for p in BRIDGE.glob("*.py")) == ["__init__.py", "_jax_memory.py", "dlpack.py"]


def _runtime_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The ``attn_jax`` modules ``path`` imports at run time, at any depth (imports under
    ``if TYPE_CHECKING:`` are not run, so they are left out)."""
    import ast

    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            }
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out & modules


def test_the_import_graph_has_no_circle():
    """No module of attn_jax imports (at run time, at any depth) one that imports it back,
    directly or through others: each circle found is named."""
    paths = {}
    for path in (ROOT / "attn_jax").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        paths[name.removesuffix(".__init__")] = path
    graph = {name: _runtime_imports(path, set(paths)) for name, path in paths.items()}
    circles, state = [], {}

    def visit(name: str, trail: list[str]) -> None:  # depth-first: a module on the trail seen again closes a circle
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                circles.append(" -> ".join(trail[trail.index(other) :] + [other]))
            elif other not in state:
                visit(other, trail + [other])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles: " + "; ".join(circles)
