"""A serving soak on the default model (`jaxinfer.serving.soak`): random
arrivals, aborts, worker stops and restarts, stalled KV transfers and a
bounded queue over a prefill + decode + mixed cluster, plain and then
speculative (MTP), every serving invariant checked after every step.
Writes <out>.json; a broken invariant raises, naming the step and request.

  python experiments/soak.py                    # 10 minutes: 5 plain, 5 speculative
  python experiments/soak.py --minutes=1 --out=/tmp/soak
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import flags

from benchlib import cli, flag_config, model_flags
from jaxinfer.serving.soak import SoakConfig, soak

_MINUTES = flags.DEFINE_float("minutes", 10.0, "traffic time, split between plain and speculative")
_SEED = flags.DEFINE_integer("seed", 0, "traffic and fault seed")
_DRAFTS = flags.DEFINE_integer("num_draft_tokens", 2, "MTP drafts in the speculative half")
_OUT = flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results", "soak"),
                           "output prefix (.json)")
_MODEL = model_flags.define()
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  model = _MODEL.load()
  cfg, params, tokenizer = model.cfg, model.params, model.need_tokenizer()
  runs = []
  for spec in (0, _DRAFTS.value):
    config = SoakConfig(seconds=_MINUTES.value * 30, seed=_SEED.value + spec, speculative=spec)
    report = soak(cfg, params, tokenizer, config)
    print(json.dumps(report))
    runs.append(dict(report, config=dataclasses.asdict(
        dataclasses.replace(config, engine=None))))
  total = {k: sum(r[k] for r in runs) for k in ("submitted", "accepted", "refused", "aborts",
                                                "restarts", "stalls", "steps", "tokens",
                                                "violations")}
  with open(_OUT.value + ".json", "w") as f:
    json.dump(dict(model=model.name, total=total, runs=runs,
                   machine="2-core CPU dev machine, shared with other jobs"), f, indent=1)
  print(json.dumps(total))


if __name__ == "__main__":
  cli.run(main)
