"""MkDocs hook: regenerate docs/performance.md from benchmarks/results/ before a build."""

from __future__ import annotations

import importlib.util
import pathlib

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "performance_page.py"


def on_pre_build(config, **kwargs) -> None:
    spec = importlib.util.spec_from_file_location("performance_page", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write()
