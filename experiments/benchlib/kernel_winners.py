"""Which kernel to run for each case, by measurement: the candidates
`kernel_bench` would time (`candidates`, its `--dry_run`) and the winner
table of a finished run (`winner_table`, `format_winners`).

A candidate is one implementation of a case (ours on Triton or Mosaic, cuDNN
through `jax.nn.dot_product_attention`, tokamax, jax's Pallas ops, XLA,
torch), named as `kernel_bench` names it. It can win a case only where it
ran and matched the float32 reference within the run's tolerance
(`numerics_ok`): a fast wrong kernel, or one whose output was never checked,
never becomes a default. The table keeps the device, jax version and date of
the run it was read from, so a default taken from it says where it was
measured. Committed as jaxinfer/kernel_tables/kernel_winners_<device>_<date>.json,
it sets `Backend`'s Hopper defaults for library kernels
(`jaxinfer.kernel_defaults`).
"""

from __future__ import annotations

from benchlib.kernel_peers import BUILDERS, Env

# The winner table's columns, in order (`format_winners`; the test holds them).
COLUMNS = ("kernel", "case", "winner", "winner_ms", "ours_ms", "ours_over_winner", "runner_up",
           "ran", "matched")


def candidates(kernels, shapes: str, env: Env) -> dict:
  """Every case of every kernel with its candidates, built but not run:
  {kernel: [{"case": label, "shape": {...}, "candidates": [{"name",
  "skip"}]}]}; skip is why a candidate would not run here ("" if it would)."""
  out = {}
  for kernel in kernels:
    out[kernel] = [dict(case=case.label, shape=case.shape,
                        candidates=[dict(name=name, skip=impl.skip)
                                    for name, impl in case.impls.items()])
                   for case in BUILDERS[kernel](env, shapes)]
  return out


def format_candidates(listing: dict) -> str:
  """`candidates` as text: a line per case, then its candidates."""
  lines = []
  for kernel, cases in listing.items():
    for c in cases:
      lines.append(f"{kernel:<7} {c['case']}")
      for cand in c["candidates"]:
        lines.append(f"          {cand['name']:<28} "
                     + (f"(not here: {cand['skip']})" if cand["skip"] else "runs here"))
  return "\n".join(lines)


def _ms(rec) -> float | None:
  return None if rec is None or "time_s" not in rec else rec["time_s"] * 1e3


def winner_row(kernel: str, entry: dict) -> dict:
  """One case of a `kernel_bench` result -> its winner-table row: the
  fastest candidate that ran and matched the reference (None where none
  did), the runner-up by the same rule, ours' time and ours / winner, and
  every candidate's time that ran (ms: what `jaxinfer.kernel_defaults`
  weighs once the table is committed)."""
  impls = entry["impls"]
  ran = {n: r for n, r in impls.items() if r.get("status") == "ok"}
  matched = sorted((r["time_s"], n) for n, r in ran.items() if r.get("numerics_ok") is True)
  winner = matched[0][1] if matched else None
  ours = ran.get("ours")
  return dict(
      kernel=kernel, case=entry["label"], winner=winner,
      winner_ms=_ms(impls.get(winner)) if winner else None, ours_ms=_ms(ours),
      ours_over_winner=(ours["time_s"] / impls[winner]["time_s"]
                        if winner and ours is not None else None),
      runner_up=matched[1][1] if len(matched) > 1 else None,
      ran=sorted(ran), matched=sorted(n for _, n in matched),
      ms={n: _ms(r) for n, r in sorted(ran.items()) if "time_s" in r})


def winner_table(result: dict) -> dict:
  """A `run_kernel_bench` result -> {"meta": device, jax, date of the run,
  "rows": a `winner_row` per case}. Raises ValueError where the result is
  not a kernel_bench result (it names the missing field)."""
  for field in ("meta", "results"):
    if field not in result:
      raise ValueError(f"winner_table: not a kernel_bench result (no {field!r})")
  meta = result["meta"]
  missing = [f for f in ("device_kind", "jax", "time") if f not in meta]
  if missing:
    raise ValueError(f"winner_table: the result's meta lacks {missing}")
  rows = [winner_row(kernel, e) for kernel, entries in result["results"].items()
          for e in entries]
  return dict(meta=dict(device_kind=meta["device_kind"], jax=meta["jax"],
                        date=meta["time"][:10], dtype=meta.get("dtype")),
              columns=list(COLUMNS), rows=rows)


def winners_path(bench_json: str) -> str:
  """Where a run's winner table goes: beside its kernel_bench JSON,
  kernel_winners_<device>_<date>[_<kernels>].json."""
  head, _, tail = bench_json.rpartition("kernel_bench_")
  return head + "kernel_winners_" + tail


def format_winners(table: dict) -> str:
  """The winner table as markdown, headed by where and when it was measured."""
  m = table["meta"]
  num = lambda v, f: "-" if v is None else format(v, f)
  lines = [f"Measured on {m['device_kind']}, jax {m['jax']}, {m['date']} ({m['dtype']}).", "",
           "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  for r in table["rows"]:
    cells = [r["kernel"], r["case"], r["winner"] or "none matched", num(r["winner_ms"], ".3f"),
             num(r["ours_ms"], ".3f"), num(r["ours_over_winner"], ".2f"), r["runner_up"] or "-",
             ", ".join(r["ran"]) or "-", ", ".join(r["matched"]) or "-"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
