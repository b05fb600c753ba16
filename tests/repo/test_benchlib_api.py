"""`experiments/` (the scripts and `benchlib`) reaches no private `jaxinfer`
name: no `from jaxinfer... import _x`, no `jaxinfer.x._y`, no `obj._x` on a
jaxinfer object. What a benchmark needs of the Engine's device state goes
through `jaxinfer.engine.inspect`; the MoE expert paths are `models.moe`'s
public functions.

Practically: every attribute access `._x` (not a dunder) in a module under
experiments/ fails unless its base is `self` / `cls`, a benchlib module, or
an entry of ALLOWED (third-party objects: transformers' configs, jax's
arrays and compiled programs, absl's flags), each named by file, base and
attribute; and so does `getattr` / `setattr` / `hasattr` of a `"_x"` name."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parents[2]
EXPERIMENTS = ROOT / "experiments"
BENCHLIB = {p.stem for p in (EXPERIMENTS / "benchlib").glob("*.py")}

# (file relative to experiments/, the base as source text, attribute): not jaxinfer's.
ALLOWED = {
    ("benchlib/decode.py", "hf.config", "_attn_implementation"),  # transformers' config
    ("benchlib/gpu_executable.py", "compiled", "_executable"),  # jax's Compiled
    ("benchlib/gpu_executable.py", "compiled._executable", "_unloaded_executable"),
    ("benchlib/host_overlap.py", "_ARRAY", "_value"),  # jax's ArrayImpl host value
    ("benchlib/flag_config.py", "config_flags_impl", "_ConfigFlag"),  # ml_collections' config flag
    ("benchlib/torch_peer.py", "model", "_compiled_call"),  # a torch.compile'd module
    ("benchlib/torch_peer.py", "model.config", "_attn_implementation"),  # transformers'
}


def _modules():
  return sorted(list(EXPERIMENTS.glob("*.py")) + list((EXPERIMENTS / "benchlib").glob("*.py")))


def _private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(base: ast.expr, module_aliases: set[str]) -> bool:
  """self / cls / a benchlib module (or a name bound to one)."""
  return isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in module_aliases)


def _benchlib_aliases(tree: ast.Module) -> set[str]:
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module == "benchlib":
      names |= {a.asname or a.name for a in node.names if a.name in BENCHLIB}
    elif isinstance(node, ast.Import):
      names |= {a.asname for a in node.names
                if a.asname and a.name.startswith("benchlib.")}
  return names


def _private_uses(tree: ast.Module):
  """-> (line, base source or None, private name, source text) of every
  `from jaxinfer... import _x`, `base._x` and `getattr(base, "_x")` (setattr,
  hasattr, delattr) in tree."""
  for node in ast.walk(tree):
    line = getattr(node, "lineno", 0)
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxinfer"):
      for a in node.names:
        if _private(a.name) or any(_private(part) for part in node.module.split(".")):
          yield line, None, a.name, f"from {node.module} import {a.name}"
    elif isinstance(node, ast.Attribute) and _private(node.attr):
      yield line, node.value, node.attr, ast.unparse(node)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
          and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
          and _private(node.args[1].value)):
      yield line, node.args[0], node.args[1].value, ast.unparse(node)


def reaches(path: pathlib.Path) -> list[str]:
  """The private reaches of one module: 'file:line: what' each."""
  rel = path.relative_to(EXPERIMENTS).as_posix()
  tree = ast.parse(path.read_text(), str(path))
  own, found = _benchlib_aliases(tree), []
  for line, base, name, text in _private_uses(tree):
    if base is not None and (_own(base, own) or (rel, ast.unparse(base), name) in ALLOWED):
      continue
    found.append(f"{rel}:{line}: {text}")
  return found


def test_experiments_reach_no_private_jaxinfer_name():
  found = [r for path in _modules() for r in reaches(path)]
  assert not found, ("experiments/ reaches private names (give jaxinfer a public one, e.g. "
                     "jaxinfer.engine.inspect):\n" + "\n".join(found))


def test_allowed_entries_are_still_there():
  # An entry no longer needed goes, so the list stays the exact third-party set.
  for rel, base, attr in ALLOWED:
    uses = _private_uses(ast.parse((EXPERIMENTS / rel).read_text()))
    assert any(b is not None and ast.unparse(b) == base and name == attr
               for _, b, name, _ in uses), (rel, base, attr)


def test_the_check_finds_reaches(tmp_path):
  bad = tmp_path / "benchlib"
  bad.mkdir()
  (bad / "x.py").write_text(
      "from jaxinfer.models.moe import _combine\n"
      "from benchlib import results\n"
      "def f(engine, steps):\n"
      "  results._private_helper()\n"
      "  self_like = engine._model.params\n"
      "  getattr(engine._runner, '_dispatch')\n"
      "  return steps.__name__\n")
  global EXPERIMENTS
  saved, EXPERIMENTS = EXPERIMENTS, tmp_path
  try:
    found = reaches(bad / "x.py")
  finally:
    EXPERIMENTS = saved
  assert sorted(f.split(": ", 1)[1] for f in found) == sorted([
      "from jaxinfer.models.moe import _combine", "engine._model",
      "getattr(engine._runner, '_dispatch')", "engine._runner"]), found
