"""Every bench/*.py script imports (without running: each runs under ``__main__`` only),
and every name it reads is bound somewhere: a bench that names ``Client`` without
importing it fails here, not an hour into a measurement."""
from __future__ import annotations

import ast
import builtins
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def _import(path: Path):
    name = f"bench_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it runs
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


def _bound(tree: ast.AST) -> set[str]:
    """Every name the file binds anywhere (a deliberately loose scope: what is never bound
    at all is surely unbound)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
    return names


def test_there_are_bench_scripts():
    assert len(SCRIPTS) > 5


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_imports_and_names_only_what_it_binds(path: Path):
    module = _import(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    known = _bound(tree) | set(dir(builtins)) | set(vars(module)) | {"__file__", "__name__"}
    unbound = sorted({(node.id, node.lineno) for node in ast.walk(tree)
                      if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
                      and node.id not in known})
    assert not unbound, f"{path.name} reads names it never binds or imports: {unbound}"
