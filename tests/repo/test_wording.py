"""No file in the repository names the work period a figure came from (issue 72).

Results are named by machine and date (`<what>_<machine>_<date>.json`), and
prose says where and when a figure was measured ("a 2-core AMD EPYC,
2026-11-29"), never which work period of the team made it. So every tracked
text file (`git ls-files`) is free of that word (`_S`, singular or plural,
any case) but for the uses listed in `ALLOWED`, each an API or a tool's own
output matched exactly where it occurs, and no tracked path contains it.
This file spells the word only in halves, so it is scanned like the rest.

An identifier that only contains the word (a subprocess's new-group flag,
aiohttp's client class, a pytest hook, a count of conversations, a Ray
temporary directory) is not the word and needs no entry.
"""

from __future__ import annotations

import fnmatch
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).parents[2]
# The word is spelled in two halves, and the patterns below write it as {s}
# ({S} capitalized), so this file never holds it whole.
_S = "se" + "ssion"


def _w(text: str) -> str:
  return text.replace("{s}", _S).replace("{S}", _S.capitalize())


WORD = re.compile(_w(r"\b{s}s?\b"), re.I)

_CONVERSATION = "a multi-turn conversation's id in the serving workloads (an API name)"
# (files, pattern, what it is): the word is allowed in the files the glob
# matches where the pattern's match covers it.
ALLOWED = [
    ("tests/wan_tiny.py", _w(r'scope="{s}"'), _w("pytest's {s}-scoped fixtures")),
    ("tests/serving/test_http_fuzz.py", _w(r"\brequests\.{S}\b"), _w("requests' HTTP {s} object")),
    ("tests/serving/test_http_fuzz.py", _w(r"\b{s}=seen\.http\(\)"),
     _w("schemathesis's Case.call({s}=...) argument")),
    ("experiments/results/gpu/*/*.log", _w(r"^=+ test {s} starts =+$"),
     "pytest's own banner, in a raw log of a GPU run"),
    ("jaxinfer/serving/workloads.py", _w(r"^  {s}: int = -1 "), _CONVERSATION),
    ("jaxinfer/serving/workloads.py", _w(r"\b{s}=s, turn=t\)"), _CONVERSATION),
    ("tests/serving/test_serving_workloads.py", _w(r"\(it\.{s}, it\.turn\)"), _CONVERSATION),
    ("experiments/serve_bench.py", _w(r'DEFINE_integer\("{s}s", '), _CONVERSATION),
    ("experiments/serve_bench.py", _w(r"\bFLAGS\.{s}s\b"), _CONVERSATION),
    ("experiments/serve_bench.py", _w(r'"layout", "{s}s",'), _CONVERSATION),
    ("tests/repo/test_readme_commands.py", _w(r'"--{s}s=2"'), _CONVERSATION),
    ("experiments/results/serve_bench_*.json", _w(r'^  "{s}s": \d+,$'),
     _w("serve_bench's --{s}s flag as its result file records it")),
]


def _tracked() -> list[str]:
  out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=120)
  assert out.returncode == 0, f"git ls-files failed: {out.stderr.decode()[-500:]}"
  paths = [p for p in out.stdout.decode().split("\0") if p]
  assert len(paths) > 100, "git ls-files listed too few files to be this repository"
  return paths


def _text(path: str) -> str | None:
  """The file's text, or None for a binary file or one missing from the tree."""
  try:
    data = (ROOT / path).read_bytes()
  except (FileNotFoundError, IsADirectoryError):
    return None
  if b"\0" in data:
    return None
  return data.decode("utf-8", errors="replace")


def _allowed_spans(path: str, text: str) -> list[tuple[int, int, int]]:
  """(start, end, index into ALLOWED) of every allowed use in the file."""
  return [(m.start(), m.end(), i) for i, (glob, pattern, _) in enumerate(ALLOWED)
          if fnmatch.fnmatch(path, glob) for m in re.finditer(pattern, text, re.M)]


def _scan():
  bad, used = [], set()
  for path in _tracked():
    text = _text(path)
    if text is None or not WORD.search(text):
      continue
    spans = _allowed_spans(path, text)
    for m in WORD.finditer(text):
      covering = [i for s, e, i in spans if s <= m.start() and m.end() <= e]
      if covering:
        used.update(covering)
        continue
      line_no = text.count("\n", 0, m.start()) + 1
      line = text.splitlines()[line_no - 1].strip()
      bad.append(f"{path}:{line_no}: {line[:160]}")
  return bad, used


def test_no_tracked_file_names_the_work_period_it_came_from():
  bad, _ = _scan()
  assert not bad, ("name results and runs by machine and date, not by work period "
                   "(or, for an API's own name, add an exact entry to ALLOWED):\n" + "\n".join(bad))


def test_every_allowed_use_still_occurs():
  # An entry whose use is gone would later let the word back in unnoticed.
  _, used = _scan()
  stale = [ALLOWED[i][:2] for i in range(len(ALLOWED)) if i not in used]
  assert not stale, stale


def test_no_tracked_path_holds_the_word():
  bad = [p for p in _tracked() if _w("{s}") in p.lower()]
  assert not bad, bad


def test_the_check_finds_the_forbidden_wording():
  # The scan is not vacuous: prose of the kind it forbids is found, and the
  # allowed uses are found only where they occur as listed.
  for prose in (_w("measured in {s} 33"), _w("Earlier {s}s ran it"), _w("this {S}'s run")):
    assert WORD.search(prose), prose
  text = _w('x = requests.{S}()\n{s} started\n')
  spans = _allowed_spans("tests/serving/test_http_fuzz.py", text)
  words = list(WORD.finditer(text))
  assert len(words) == 2
  assert any(s <= words[0].start() and words[0].end() <= e for s, e, _ in spans)
  assert not any(s <= words[1].start() and words[1].end() <= e for s, e, _ in spans)
  assert not _allowed_spans("README.md", text)
  for identifier in (_w("start_new_{s}=True"), _w("aiohttp.Client{S}()"), _w("pytest_{s}finish"),
                     _w("num_{s}s"), _w("/tmp/ray/{s}_latest")):
    assert not WORD.search(identifier), identifier
