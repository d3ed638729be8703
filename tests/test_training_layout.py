"""training/ stays readable: no function longer than MAX_FUNCTION_LINES, and the loop's state is a typed
LoopState (named fields), never a string-keyed dict."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

TRAINING = Path(__file__).resolve().parents[1] / "src" / "peftlab" / "training"
MAX_FUNCTION_LINES = 60


def function_lengths() -> list[tuple[int, str]]:
    """(lines, "module.py:qualified name") of every function and method in training/, longest first; a
    function's lines run from its ``def`` (decorators included) to its last line, docstring included."""
    found: list[tuple[int, str]] = []
    for path in sorted(TRAINING.glob("*.py")):
        collect(ast.parse(path.read_text(), filename=str(path)), f"{path.name}:", found)
    return sorted(found, reverse=True)


def collect(node: ast.AST, prefix: str, found: list) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([child.lineno] + [d.lineno for d in child.decorator_list])
            found.append((child.end_lineno - start + 1, prefix + child.name))
            collect(child, f"{prefix}{child.name}.", found)
        elif isinstance(child, ast.ClassDef):
            collect(child, f"{prefix}{child.name}.", found)
        else:
            collect(child, prefix, found)


def test_every_function_in_training_is_at_most_60_lines():
    lengths = function_lengths()
    assert len(lengths) > 50 and any(name == "fit.py:fit" for _, name in lengths)  # the walk found them all
    longest = ", ".join(f"{name} {lines}" for lines, name in lengths[:5])
    assert lengths[0][0] <= MAX_FUNCTION_LINES, f"longest functions in training/ (max {MAX_FUNCTION_LINES}): {longest}"


def test_the_length_count_sees_a_long_function(tmp_path, monkeypatch):
    body = "\n".join(f"    x{i} = {i}" for i in range(70))
    (tmp_path / "long.py").write_text(f"class A:\n    @staticmethod\n    def long():\n{body.replace('    ', '        ')}\n")
    monkeypatch.setattr(sys.modules[__name__], "TRAINING", tmp_path)
    assert function_lengths() == [(72, "long.py:A.long")]


def string_keyed_state(path: Path) -> list[str]:
    """``state["..."]`` / ``run.state["..."]`` subscripts, and ``state.get("...")`` / ``state.setdefault``."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        target = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            target = node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "setdefault", "pop", "update")):
            target = node.func.value
        name = getattr(target, "id", getattr(target, "attr", None))
        if name == "state":
            bad.append(f"{path.name}:{node.lineno}")
    return bad


def test_the_loop_state_is_never_a_string_keyed_dict():
    bad = [hit for path in sorted(TRAINING.glob("*.py")) for hit in string_keyed_state(path)]
    assert not bad, f"string-keyed loop state (use LoopState's fields): {bad}"


def test_the_state_check_finds_a_string_key(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('def f(run, state):\n    run.state["epoch"] += 1\n    return state.get("best")\n')
    assert string_keyed_state(sample) == ["sample.py:2", "sample.py:3"]
