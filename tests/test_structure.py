"""The library's size rules, so that every unit stays readable at a glance: no library file over 600 lines, no
class over 150, no function over 80."""

import ast
from pathlib import Path

import pytest

import sublinear

LIMITS = {"file": 600, "class": 150, "function": 80}
ROOT = Path(sublinear.__file__).parent
FILES = sorted(ROOT.rglob("*.py"))


def _oversized(path: Path) -> list[str]:
    source = path.read_text()
    found = [f"{path.name}: {source.count(chr(10))} lines"] if source.count("\n") > LIMITS["file"] else []
    for node in ast.walk(ast.parse(source)):
        kind = "class" if isinstance(node, ast.ClassDef) else \
            "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if kind and node.end_lineno - node.lineno + 1 > LIMITS[kind]:
            found.append(f"{path.name}:{node.lineno} {kind} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_library_file_class_or_function_is_over_its_size_limit(path):
    assert _oversized(path) == []


def test_the_rule_finds_an_oversized_function(tmp_path):
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * LIMITS["function"])
    assert _oversized(long) == [f"long.py:1 function f: {LIMITS['function'] + 1} lines"]
