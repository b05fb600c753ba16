"""Code stays small enough to read (docs/style.md): no function over 60 lines and
no class over 300 lines outside `pallas_kernels/` (kernels keep their bodies
whole, as Pallas kernels read best).

Lengths are counted with `ast` from the `def` / `class` line to the last
line of the body, docstrings and comments included.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[2]
CHECKED = ("jaxinfer", "experiments", "configs")
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300


def _sizes(kind) -> list[tuple[str, int]]:
  """(file:name, lines) of every `kind` node in the checked trees."""
  out = []
  for top in CHECKED:
    for f in sorted((ROOT / top).rglob("*.py")):
      for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, kind):
          out.append((f"{f.relative_to(ROOT)}:{node.lineno} {node.name}",
                      node.end_lineno - node.lineno + 1))
  return out


def test_walker_sees_the_code():
  functions = _sizes((ast.FunctionDef, ast.AsyncFunctionDef))
  assert len(functions) > 500, "the size check found too few functions to be looking at the code"
  assert any(name.endswith(" generate") for name, _ in functions)


@pytest.mark.parametrize("kind,limit", [((ast.FunctionDef, ast.AsyncFunctionDef),
                                         MAX_FUNCTION_LINES),
                                        (ast.ClassDef, MAX_CLASS_LINES)],
                         ids=["functions", "classes"])
def test_no_long_definitions(kind, limit):
  long = [f"{name} ({n} lines)" for name, n in _sizes(kind) if n > limit]
  assert not long, f"over {limit} lines:\n" + "\n".join(long)
