"""The import graph of jaxinfer, pallas_kernels and the experiments' benchmark
library (experiments/benchlib, imported as `benchlib`) has no cycle, no
module hides one behind a function-local import (docs/style.md, "Avoid"),
and no module imports from a floor above its own: the floors are the rows of
docs/design.md's layers table, top to bottom, read from its `where` column
(written down there once). The attention kind is asked (`Attention.latent`),
never compared with its name.

Every `import` / `from ... import` is read with `ast`, module-level and
function-local alike, so a cycle cannot be hidden from this test either.
Importing a module runs its parent packages' `__init__` first; those implicit
edges are left out (Python resolves them: the parent is already in
`sys.modules`), the explicit ones (`from jaxinfer import engine`) are in.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).parents[2]
# Package -> the folder its top-level directory sits in (what sys.path holds).
PACKAGES = {"jaxinfer": ROOT, "pallas_kernels": ROOT, "native_kernels": ROOT,
            "benchlib": ROOT / "experiments"}

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


# ---------------------------------------------------------------- floors

DESIGN = ROOT / "docs" / "design.md"


def _module_prefix(path: str) -> str | None:
  """A `where` path of the layers table -> the dotted module (a file) or
  package prefix (a folder) it names; None for paths outside PACKAGES
  (experiments/*.py, configs/*.py: scripts, not imported modules)."""
  for pkg, base in PACKAGES.items():
    rel = (base / pkg).relative_to(ROOT).as_posix()
    if path == rel or path.startswith(rel + "/"):
      inner = path[len(rel):].strip("/")
      parts = [pkg, *[p for p in inner.removesuffix(".py").split("/") if p]]
      if parts[-1] == "__init__":
        parts = parts[:-1]
      return ".".join(parts)
  return None


def floors() -> list[tuple[str, list[str]]]:
  """docs/design.md's layers table, top to bottom: [(layer, [where paths])]."""
  text = DESIGN.read_text()
  section = text[text.index("## Layers, top to bottom"):text.index("## Core contracts")]
  out = []
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 3 and cells[0] not in ("layer", "---"):
      out.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
  return out


def floor_of(module: str, table) -> int | None:
  """The floor (0 = the top row) of a module: the row naming its file, or
  else the row of the longest folder holding it."""
  best, best_len = None, -1
  for i, (_, paths) in enumerate(table):
    for path in paths:
      prefix = _module_prefix(path)
      if prefix is None:
        continue
      is_file = path.endswith(".py")
      if module == prefix or (not is_file and module.startswith(prefix + ".")):
        size = len(prefix) + (1000 if is_file else 0)  # a named file beats its folder
        if size > best_len:
          best, best_len = i, size
  return best


def test_the_floors_table_names_real_paths():
  table = floors()
  assert [name for name, _ in table][:2] == ["experiments", "configs"]
  assert table[-1] == ("kernels", ["pallas_kernels/", "native_kernels/"]), table[-1]
  missing = [p for _, paths in table for p in paths
             if not (list(ROOT.glob(p)) if "*" in p else (ROOT / p).exists())]
  assert not missing, f"docs/design.md's layers table names missing paths: {missing}"
  names = {name for name, _ in table}
  assert len(names) == len(table), "a layer named twice"


def test_every_module_sits_on_a_floor():
  table = floors()
  loose = sorted(m for m in module_files() if floor_of(m, table) is None)
  assert not loose, ("modules on no floor of docs/design.md's layers table (add their "
                     f"path to a row's where column): {loose}")


def test_the_kv_package_straddles_the_models():
  # kv/contexts.py and kv/pool.py (what the models write through) sit below
  # the models, the rest of kv above them; the engine above all of kv.
  table = floors()
  f = lambda m: floor_of(m, table)
  assert f("jaxinfer.kv.contexts") == f("jaxinfer.kv.pool") > f("jaxinfer.models.transformer")
  assert f("jaxinfer.models.transformer") > f("jaxinfer.kv.cache") == f("jaxinfer.kv.scales")
  assert f("jaxinfer.kv.cache") > f("jaxinfer.engine.kv_calibration")
  assert f("jaxinfer.ops") > f("jaxinfer.kv.pool") and f("native_kernels") == len(table) - 1


def test_no_module_imports_from_a_floor_above_its_own():
  table = floors()
  edges, _ = import_graph()
  up = []
  for module, targets in sorted(edges.items()):
    here = floor_of(module, table)
    for target in sorted(targets):
      there = floor_of(target, table)
      if here is not None and there is not None and there < here:
        up.append(f"{module} ({table[here][0]}) imports {target} ({table[there][0]})")
  assert not up, "imports up a floor (docs/design.md's layers table):\n" + "\n".join(up)


# ------------------------------------------------------- the attention kind

# `ModelConfig.attention` is an `Attention` value: code asks it (`.latent`),
# never compares it with "gqa" / "mla".
_NAME = r"""["'](?:gqa|mla)["']"""
ATTENTION_BY_NAME = re.compile(
    rf"attention\s*(?:==|!=)\s*{_NAME}|{_NAME}\s*(?:==|!=)\s*[\w.]*attention\b"
    rf"|attention\s+(?:not\s+)?in\s+[(\[{{]\s*{_NAME}")
# Files other changes are rewriting; remove an entry once its fix lands.
KNOWN_ATTENTION_BY_NAME: set = set()
# The tests of the check and of the value itself (that outside code's name
# comparisons keep working).
CHECKS_ITSELF = {"tests/repo/test_imports.py", "tests/kv/test_attention_value.py"}


def test_no_code_compares_the_attention_kind_with_its_name():
  assert ATTENTION_BY_NAME.search('if cfg.attention == "mla":')
  assert ATTENTION_BY_NAME.search("ok = 'gqa' != self.cfg.attention")
  assert ATTENTION_BY_NAME.search('c.attention in ("gqa", "mla")')
  assert not ATTENTION_BY_NAME.search('backend.attention == "mosaic"')
  found = {}
  for top in ("jaxinfer", "pallas_kernels", "experiments", "tests", "configs"):
    for f in sorted((ROOT / top).rglob("*.py")):
      rel = f.relative_to(ROOT).as_posix()
      if rel in CHECKS_ITSELF:
        continue
      lines = [f"{rel}:{i}: {l.strip()}" for i, l in enumerate(f.read_text().splitlines(), 1)
               if ATTENTION_BY_NAME.search(l)]
      if lines:
        found[rel] = lines
  new = {k: v for k, v in found.items() if k not in KNOWN_ATTENTION_BY_NAME}
  assert not new, ("compare the attention kind by value (cfg.attention.latent), not by name:\n"
                   + "\n".join(l for v in new.values() for l in v))
  fixed = KNOWN_ATTENTION_BY_NAME - set(found)
  assert not fixed, f"fixed, remove from KNOWN_ATTENTION_BY_NAME: {sorted(fixed)}"
