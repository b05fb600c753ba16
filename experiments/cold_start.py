"""A server's cold start and warm start, timed from the command
(`benchlib.cold_start`): `experiments/serve.py` with an empty compilation
cache, its first request (a 16-token greedy completion) sent as soon as the
port answers; then the same command again, reading the programs back from
the cache. Reports, per start, the seconds to the port, to the first
completed request and (--wait_warm) to the end of the background warm-up,
the step programs compiled by then, and the server's memory maps.

  python experiments/cold_start.py
  python experiments/cold_start.py --wait_warm                 # also time the whole warm-up
  python experiments/cold_start.py --serve_flags=--warmup_before_serving   # the old order

Writes experiments/results/cold_start_<machine>_<date>.json.
"""

import datetime
import os
import tempfile

from absl import flags

from benchlib import cli, cold_start, flag_config, results
from benchlib.results import machine_info

_SERVE_FLAGS = flags.DEFINE_list("serve_flags", [], "flags passed on to serve.py")
_WAIT_WARM = flags.DEFINE_bool("wait_warm", False, "wait for /health to say ok (the whole "
                               "background warm-up) in each start")
_TIMEOUT = flags.DEFINE_float("timeout_s", 1800.0, "longest wait for each start")
_MACHINE = flags.DEFINE_string("machine", "epyc2c", "short machine name for the output file")
_OUT = flags.DEFINE_string("out", None, "output prefix (default "
                           "experiments/results/cold_start_<machine>_<date>)")
_CONFIG = flag_config.define_config(__file__)


def _row(name: str, r: dict) -> dict:
  f = r["first"]
  print(f"{name}: port after {r['port_s']:.1f} s, first request done after {f['s']:.1f} s "
        f"({f['compiles']} step programs compiled, {f['maps']} memory maps, health "
        f"{f['health']['status']})" + (f"; warm-up done after {r['warm']['s']:.1f} s "
                                         f"({r['warm']['compiles']} programs, "
                                         f"{r['warm']['maps']} maps)" if "warm" in r else ""))
  return dict(start=name, **r)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  load_before = os.getloadavg()
  with tempfile.TemporaryDirectory() as cache:
    r = cold_start.run(cache, flags=_SERVE_FLAGS.value, wait_warm=_WAIT_WARM.value,
                       timeout_s=_TIMEOUT.value)
  rows = [_row("cold", r["cold"]), _row("warm", r["warm"])]
  today = datetime.date.today().isoformat()
  results.write(_OUT.value or f"experiments/results/cold_start_{_MACHINE.value}_{today}", rows,
                None, serve_flags=_SERVE_FLAGS.value, request=cold_start.REQUEST,
                same_text=r["same_text"], machine=machine_info(),
                load_average=dict(before=load_before, after=os.getloadavg()),
                note="seconds from the serve.py command; cold: an empty compilation cache, "
                     "warm: the cold start's cache; compiles: step programs compiled "
                     "(jaxinfer_compiles); maps: lines of the server's /proc/PID/maps")


if __name__ == "__main__":
  cli.run(main)
