"""No function in bench/ runs over 80 lines: a benchmark reads as its parsing, its set-up,
its run and its result, each a function of its own (issue 30)."""

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
MOST_LINES = 80


def long_functions(path: Path, most_lines: int = MOST_LINES) -> list[str]:
    """``file:line name (N lines)`` for each function or method (nested ones too) in
    ``path`` longer than ``most_lines``, its decorators and docstring counted."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
            lines = node.end_lineno - first + 1
            if lines > most_lines:
                found.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_benchmark_function_is_over_80_lines():
    long = [entry for path in sorted(BENCH.glob("*.py")) for entry in long_functions(path)]
    assert not long, "split these by concept (parsing, set-up, the run, the result):\n" + "\n".join(long)


def test_the_check_counts_a_function_from_its_decorators_to_its_last_line(tmp_path):
    module = tmp_path / "module.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    module.write_text(f"import functools\n\n\n@functools.cache\ndef long():\n{body}\n\n\ndef short():\n    pass\n")
    assert long_functions(module) == ["module.py:5 long (82 lines)"]
    assert long_functions(module, most_lines=82) == []
