"""The library's shape, as the contributing guide asks of it: no function longer than a screen, and the
estimator's class small enough to read (its fitted-model methods live in ``fitted_model``)."""

from __future__ import annotations

import ast
from pathlib import Path

import scalable_xd

SRC = Path(scalable_xd.__file__).parent
LONGEST_FUNCTION = 80  # lines, its decorators excluded
LONGEST_ESTIMATOR = 300  # lines of the XDGMM class


def _definitions(kind):
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, kind):
                yield path.relative_to(SRC), node, node.end_lineno - node.lineno + 1


def test_no_function_is_longer_than_a_screen():
    functions = _definitions(ast.FunctionDef)
    long = [f"{path}:{node.name} ({n} lines)" for path, node, n in functions if n > LONGEST_FUNCTION]
    assert not long, f"functions over {LONGEST_FUNCTION} lines: {long}"


def test_the_estimator_class_stays_readable():
    (n,) = [n for path, node, n in _definitions(ast.ClassDef) if node.name == "XDGMM"]
    assert n <= LONGEST_ESTIMATOR
