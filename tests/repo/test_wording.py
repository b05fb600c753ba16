"""No file in the repository speaks of work sessions (issue 72).

Results are named by machine and date (`<what>_<machine>_<date>.json`), and
prose says where and when a figure was measured ("a 2-core AMD EPYC,
2026-11-29"), never which work session made it ("session 33", "earlier
sessions", "this session"). So every tracked text file (`git ls-files`) is
free of the word "session" / "sessions" but for the uses listed in `ALLOWED`,
each an API or a tool's own output matched exactly where it occurs, and no
tracked path contains "session". This file, which must name what it
forbids, is the one file not scanned.

An identifier that only contains the word (`start_new_session`,
`aiohttp.ClientSession`, `pytest_sessionfinish`, `num_sessions`, a Ray
`session_<date>` directory) is not the word and needs no entry.
"""

from __future__ import annotations

import fnmatch
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).parents[2]
WORD = re.compile(r"\bsessions?\b", re.I)
# This file spells out what it forbids; it is the one file not scanned.
SELF = pathlib.Path(__file__).resolve().relative_to(ROOT.resolve()).as_posix()

_CONVERSATION = "a multi-turn conversation's id in the serving workloads (an API name)"
# (files, pattern, what it is): the word is allowed in the files the glob
# matches where the pattern's match covers it.
ALLOWED = [
    ("tests/wan_tiny.py", r'scope="session"', "pytest's session-scoped fixtures"),
    ("tests/serving/test_http_fuzz.py", r"\brequests\.Session\b", "requests' HTTP session object"),
    ("tests/serving/test_http_fuzz.py", r"\bsession=seen\.http\(\)",
     "schemathesis's Case.call(session=...) argument"),
    ("experiments/results/gpu/*/*.log", r"^=+ test session starts =+$",
     "pytest's own banner, in a raw log of a GPU run"),
    ("jaxinfer/serving/workloads.py", r"^  session: int = -1 ", _CONVERSATION),
    ("jaxinfer/serving/workloads.py", r"\bsession=s, turn=t\)", _CONVERSATION),
    ("tests/serving/test_serving_workloads.py", r"\(it\.session, it\.turn\)", _CONVERSATION),
    ("experiments/serve_bench.py", r'DEFINE_integer\("sessions", ', _CONVERSATION),
    ("experiments/serve_bench.py", r"\bFLAGS\.sessions\b", _CONVERSATION),
    ("experiments/serve_bench.py", r'"layout", "sessions",', _CONVERSATION),
    ("tests/repo/test_readme_commands.py", r'"--sessions=2"', _CONVERSATION),
    ("experiments/results/serve_bench_*.json", r'^  "sessions": \d+,$',
     "serve_bench's --sessions flag as its result file records it"),
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
    if path == SELF:
      continue
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


def test_no_tracked_file_speaks_of_sessions():
  bad, _ = _scan()
  assert not bad, ("name results and runs by machine and date, not by work session "
                   "(or, for an API's own name, add an exact entry to ALLOWED):\n" + "\n".join(bad))


def test_every_allowed_use_still_occurs():
  # An entry whose use is gone would later let the word back in unnoticed.
  _, used = _scan()
  stale = [ALLOWED[i][:2] for i in range(len(ALLOWED)) if i not in used]
  assert not stale, stale


def test_no_tracked_path_names_a_session():
  bad = [p for p in _tracked() if "session" in p.lower()]
  assert not bad, bad


def test_the_check_finds_work_session_wording():
  # The scan is not vacuous: prose of the kind it forbids is found, and the
  # allowed uses are found only where they occur as listed.
  for prose in ("measured in session 33", "Earlier sessions ran it", "this Session's run"):
    assert WORD.search(prose), prose
  text = 'x = requests.Session()\nsession started\n'
  spans = _allowed_spans("tests/serving/test_http_fuzz.py", text)
  words = list(WORD.finditer(text))
  assert len(words) == 2
  assert any(s <= words[0].start() and words[0].end() <= e for s, e, _ in spans)
  assert not any(s <= words[1].start() and words[1].end() <= e for s, e, _ in spans)
  assert not _allowed_spans("README.md", text)
  for identifier in ("start_new_session=True", "aiohttp.ClientSession()", "pytest_sessionfinish",
                     "num_sessions", "/tmp/ray/session_latest"):
    assert not WORD.search(identifier), identifier
