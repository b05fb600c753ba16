"""docs/ and the README cannot drift from the code.

A docstring quoted in docs/*.md is written as

  <!-- docstring: jaxinfer.engine.engine.Engine.submit -->
  ```text
  ...the docstring, exactly as inspect.getdoc returns it...
  ```

and must equal `inspect.getdoc` of the named object (a dotted import path) or,
for a name ending in .py, the module docstring of that repository file. Every
`experiments/*.py` script and `colab/*.ipynb` notebook the README or the docs
mention must exist, and every docs page the README and docs/README.md link to.
"""

import ast
import importlib
import inspect
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LAYER_PAGES = ["model", "kernels", "sharding", "engine", "serving", "experiments"]
QUOTE = re.compile(r"<!-- docstring: (\S+) -->\n```text\n(.*?)\n```", re.S)


def resolve(name: str):
  """A dotted name -> the object: the longest importable module prefix, then attributes."""
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for attr in parts[i:]:
      obj = getattr(obj, attr)
    return obj
  raise ImportError(f"cannot import any prefix of {name}")


def docstring(name: str) -> str | None:
  if name.endswith(".py"):
    return ast.get_docstring(ast.parse((ROOT / name).read_text()), clean=True)
  return inspect.getdoc(resolve(name))


def quotes():
  for page in DOCS:
    for m in QUOTE.finditer(page.read_text()):
      yield pytest.param(page.name, m.group(1), m.group(2), id=f"{page.stem}:{m.group(1)}")


def test_a_page_per_layer():
  assert {p.stem for p in DOCS} >= set(LAYER_PAGES) | {"README"}


@pytest.mark.parametrize("page,name,quoted", list(quotes()))
def test_quoted_docstring_is_current(page, name, quoted):
  current = docstring(name)
  assert current, f"{page}: {name} has no docstring"
  assert quoted == current, (f"{page}: the docstring of {name} changed; paste the new one:\n"
                             f"{current}")


def test_every_layer_page_quotes_the_code():
  for stem in LAYER_PAGES:
    text = (ROOT / "docs" / f"{stem}.md").read_text()
    assert len(QUOTE.findall(text)) >= 3, f"docs/{stem}.md quotes fewer than 3 docstrings"
    # A marker whose block is malformed would silently not be checked.
    assert text.count("<!-- docstring:") == len(QUOTE.findall(text)), stem


def _texts():
  return {p.relative_to(ROOT): p.read_text() for p in [ROOT / "README.md", *DOCS]}


def test_mentioned_scripts_and_notebooks_exist():
  missing = []
  for path, text in _texts().items():
    for ref in set(re.findall(r"(?<![\w/])((?:experiments|colab)/[\w./-]+\.(?:py|ipynb))", text)):
      if not (ROOT / ref).exists():
        missing.append(f"{path}: {ref}")
  assert not missing, missing


def test_linked_pages_exist():
  missing = []
  for path, text in _texts().items():
    for link in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text):
      if "://" not in link and not ((ROOT / path).parent / link).exists():
        missing.append(f"{path}: {link}")
  assert not missing, missing


if __name__ == "__main__":
  # python tests/repo/test_docs.py: rewrites every quoted block with the current
  # docstring (review the diff: the prose around a quote may need updating too).
  # benchlib (experiments/benchlib) as pytest finds it (pyproject.toml's pythonpath).
  sys.path.insert(0, str(ROOT / "experiments"))
  for page in DOCS:
    text = page.read_text()
    new = QUOTE.sub(lambda m: f"<!-- docstring: {m.group(1)} -->\n```text\n"
                              f"{docstring(m.group(1))}\n```", text)
    if new != text:
      page.write_text(new)
      print(f"updated {page.relative_to(ROOT)}")
