"""No module of the package over 450 lines, no function over 80: past that a change means reading more than it
touches. The generated gRPC stubs are not ours to size."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src" / "gpuppetti"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(path for path in SOURCE.rglob("*.py") if "_proto" not in path.relative_to(SOURCE).parts)


def _oversized(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    found: list[str] = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
            length = (node.end_lineno or node.lineno) - first + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{node.name}, line {node.lineno}: {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def test_no_module_or_function_is_over_its_limit() -> None:
    over = {str(path.relative_to(SOURCE)): problems for path in _modules() if (problems := _oversized(path))}
    assert not over, "\n".join(f"src/gpuppetti/{name}: {'; '.join(problems)}" for name, problems in over.items())


def test_the_check_finds_what_is_over(tmp_path: Path) -> None:
    long_function = "def f() -> None:\n" + "    pass\n" * MAX_FUNCTION_LINES
    (tmp_path / "long.py").write_text(long_function)
    assert _oversized(tmp_path / "long.py") == [f"f, line 1: {MAX_FUNCTION_LINES + 1} lines (at most 80)"]
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert _oversized(tmp_path / "big.py") == [f"{MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})"]
    (tmp_path / "fine.py").write_text("def f() -> None:\n" + "    pass\n" * (MAX_FUNCTION_LINES - 1))
    assert _oversized(tmp_path / "fine.py") == []
