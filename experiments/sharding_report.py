"""Per-device params and KV bytes, analytic collectives and array shardings of a
preset on a mesh, from shapes alone (nothing is allocated; the mesh may be larger
than this machine).

  python experiments/sharding_report.py --model deepseek_v3 --mesh data=8,expert=32 \
      --layout dp_attn_ep --kv_tokens 1000000
  python experiments/sharding_report.py --model deepseek_v3 --mesh data=8,expert=36 \
      --layout dp_attn_ep --kv_tokens 1000000 --redundant_experts 32   # DeepSeek EPLB replicas
  python experiments/sharding_report.py --model llama3_8b --mesh data=2,tensor=4 --layout tp

Prints a table (GiB per device by param group, KV pool, collectives per layer kind
and per forward, PartitionSpecs and shard shapes); --json_out writes the dict.
"""

from absl import flags

from benchlib import cli, flag_config, model_flags
from benchlib.sharding_report import run_sharding_report
from jaxinfer.sharding import LAYOUTS

_MODEL = model_flags.define_preset("deepseek_v3")
_MESH = flags.DEFINE_string("mesh", "data=8,expert=32", "mesh axes, e.g. data=8,expert=36")
_LAYOUT = flags.DEFINE_enum("layout", "dp_attn_ep", list(LAYOUTS), "sharding layout")
_KV_TOKENS = flags.DEFINE_integer("kv_tokens", 0, "tokens held by the whole KV pool")
_BATCH_TOKENS = flags.DEFINE_integer("batch_tokens", 256,
                                     "tokens in one forward, over the whole mesh")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "param, activation and KV dtype")
_REDUNDANT_EXPERTS = flags.DEFINE_integer(
    "redundant_experts", 0, "extra routed-expert copies per MoE block (DeepSeek EPLB style; "
    "the spec tree has none), e.g. 32 for 256 experts on 288 ranks")
_JSON_OUT = flags.DEFINE_string("json_out", None, "write the report as JSON here")
_QUANT = flags.DEFINE_string("quant", None, "weight format: fp8, nvfp4, mxfp4, int8, int4 "
                             "(jaxinfer.presets.QUANT); default: unquantized in --dtype")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  run_sharding_report(model=_MODEL.value, mesh=_MESH.value, layout=_LAYOUT.value,
                      dtype=_DTYPE.value, kv_tokens=_KV_TOKENS.value,
                      batch_tokens=_BATCH_TOKENS.value,
                      redundant_experts=_REDUNDANT_EXPERTS.value, quant=_QUANT.value,
                      json_out=_JSON_OUT.value)


if __name__ == "__main__":
  cli.run(main)
