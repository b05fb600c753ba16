"""The import graph of jaxinfer, pallas_kernels and the experiments' benchmark
library (experiments/benchlib, imported as `benchlib`) has no cycle, and no
module hides one behind a function-local import (docs/style.md, "Avoid").

Every `import` / `from ... import` is read with `ast`, module-level and
function-local alike, so a cycle cannot be hidden from this test either.
Importing a module runs its parent packages' `__init__` first; those implicit
edges are left out (Python resolves them: the parent is already in
`sys.modules`), the explicit ones (`from jaxinfer import engine`) are in.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).parents[2]
# Package -> the folder its top-level directory sits in (what sys.path holds).
PACKAGES = {"jaxinfer": ROOT, "pallas_kernels": ROOT, "benchlib": ROOT / "experiments"}

# Function-local imports of jaxinfer / pallas_kernels / benchlib modules that stay, each
# with its reason: (importing module, imported module) -> why.
LOCAL_IMPORT_ALLOWLIST: dict[tuple[str, str], str] = {}

# Cycles (as the sorted modules of one strongly connected component) known in
# code other changes are rewriting; remove an entry once its fix lands.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def module_files() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of PACKAGES."""
  out = {}
  for pkg, base in PACKAGES.items():
    for f in sorted((base / pkg).rglob("*.py")):
      parts = f.relative_to(base).with_suffix("").parts
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = f
  return out


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
  """The absolute module a (possibly relative) `from` import names."""
  if not node.level:
    return node.module or ""
  base = module.split(".")
  base = base[:len(base) - node.level + (1 if is_package else 0)]
  return ".".join(base + ([node.module] if node.module else []))


class _Imports(ast.NodeVisitor):
  """Collects (imported name candidates, is function-local, line) per import."""

  def __init__(self, module: str, is_package: bool):
    self.module, self.is_package = module, is_package
    self.depth = 0
    self.found: list[tuple[list[str], bool, int]] = []

  def _function(self, node):
    self.depth += 1
    self.generic_visit(node)
    self.depth -= 1

  visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

  def visit_Import(self, node):
    for alias in node.names:
      self.found.append(([alias.name], self.depth > 0, node.lineno))

  def visit_ImportFrom(self, node):
    base = _absolute(self.module, self.is_package, node)
    for alias in node.names:
      # `from a import b`: module a.b if it is one, else a name inside a.
      self.found.append(([f"{base}.{alias.name}", base], self.depth > 0, node.lineno))


def import_graph():
  """-> (edges {module: {imported module}}, local [(module, imported, line)])."""
  files = module_files()
  edges = {m: set() for m in files}
  local = []
  for module, f in files.items():
    visitor = _Imports(module, f.name == "__init__.py")
    visitor.visit(ast.parse(f.read_text(), str(f)))
    for candidates, is_local, line in visitor.found:
      target = next((c for c in candidates if c in files), None)
      if target is None or target == module:
        continue
      edges[module].add(target)
      if is_local:
        local.append((module, target, line))
  return edges, local


def cycles(edges) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan), each as
  one cycle through all of its modules' first-found path."""
  index, low, stack, on_stack, comps = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        comps.append(sorted(comp))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return comps


def a_cycle(edges, comp: list[str]) -> list[str]:
  """One concrete cycle inside a strongly connected component, for the message."""
  members, start = set(comp), comp[0]
  path, seen = [start], {start}
  while True:
    nxt = sorted(w for w in edges[path[-1]] if w in members)
    back = [w for w in nxt if w in seen]
    if back:
      return path[path.index(back[0]):] + [back[0]]
    path.append(nxt[0])
    seen.add(nxt[0])


def test_graph_sees_every_module_and_the_moe_layering():
  edges, _ = import_graph()
  assert "jaxinfer.models.moe_core" in edges["jaxinfer.models.moe_ep"]
  assert "jaxinfer.models.moe_ep" in edges["jaxinfer.models.moe"]
  assert "jaxinfer.hf_config" in edges["jaxinfer.config"]
  # The benchmark library is walked too, from experiments/.
  assert {"benchlib.gpu_engine", "benchlib.kernels"} <= edges["benchlib.gpu_day"]
  assert "benchlib.results" in edges["benchlib.decode"]
  # The HF config mappers are plain-dict modules (config.py imports them).
  assert edges["jaxinfer.hf_config"] == {"jaxinfer.hf_quant_config"}
  assert not edges["jaxinfer.hf_quant_config"]
  assert not edges["jaxinfer.models.moe_core"] - {
      "jaxinfer.config", "jaxinfer.models.layers", "jaxinfer.models.quant", "jaxinfer.ops"}


def test_no_import_cycles():
  edges, _ = import_graph()
  found = {tuple(c) for c in cycles(edges)}
  new = found - KNOWN_CYCLES
  assert not new, "import cycles:\n" + "\n".join(
      " -> ".join(a_cycle(edges, list(c))) for c in sorted(new))
  gone = KNOWN_CYCLES - found
  assert not gone, f"fixed, remove from KNOWN_CYCLES: {sorted(gone)}"


def test_no_function_local_imports_of_our_modules():
  _, local = import_graph()
  bad = [f"{m}:{line} imports {t}" for m, t, line in local
         if (m, t) not in LOCAL_IMPORT_ALLOWLIST]
  assert not bad, ("function-local imports of jaxinfer/pallas_kernels/benchlib modules:\n"
                   + "\n".join(bad))
  used = {(m, t) for m, t, _ in local}
  stale = sorted(set(LOCAL_IMPORT_ALLOWLIST) - used)
  assert not stale, f"no longer imported locally, remove from the allowlist: {stale}"
