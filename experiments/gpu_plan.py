"""The Engine's step programs compiled for GPUs from this CPU machine: per-device
params, KV, temporaries (memory_analysis) against the GPU's memory, FLOPs and
bytes from shapes, and a roofline step time; or what does not fit, by how much.
From the optimized HLO: kernel launches a step and a layer, bytes of weight
copies a step, loops without a known trip count (--hlo_dir keeps the HLO).

  python experiments/gpu_plan.py --model=deepseek_v3 --mesh=data=4,expert=8 \
      --layout=dp_attn_ep --hosts=4                       # 4 hosts x 8 H100
  python experiments/gpu_plan.py --model=llama3_1_405b --mesh=tensor=8 --layout=tp
  python experiments/gpu_plan.py --model=llama3_8b --mesh=data=1 --speculative=0
  python experiments/gpu_plan.py --model=llama3_8b --num_layers=4 --hlo_dir=/tmp/hlo
  python experiments/gpu_plan.py --model=llama3_8b --weights=stacked   # scanned: copies

The steps hold the weights per layer, as a GPU Engine does (every weight read
in place; a full-depth step compiles in minutes on a small CPU);
--weights=stacked compiles the scanned steps (seconds; each layer's weights
copied out of the stack every step).

Needs the GPU compile toolchain (`pip install -e ".[gpu-compile]"`); nothing is
allocated (abstract params, pool and batches).
"""

import os

# Compile-only GPUs need no GPU: keep the CUDA plugin from trying to start one.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags

from benchlib import cli, flag_config, model_flags
from benchlib.gpu_plan import run_gpu_plan
from jaxinfer.gpu_compile import TARGETS
from jaxinfer.sharding import LAYOUTS

_MODEL = model_flags.define_preset("llama3_8b")
_MESH = flags.DEFINE_string("mesh", "data=1", "mesh axes, e.g. data=4,expert=8")
_LAYOUT = flags.DEFINE_enum("layout", "tp", list(LAYOUTS), "sharding layout")
_HOSTS = flags.DEFINE_integer("hosts", 1, "hosts the mesh's devices are spread over")
_GPU = flags.DEFINE_enum("gpu", "h100", sorted(TARGETS), "GPU model")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "param, activation and KV dtype")
_BATCH = flags.DEFINE_integer("batch", 32, "sequences per step (per attention-DP rank)")
_CONTEXT = flags.DEFINE_integer("context", 4096, "tokens of context per sequence")
_PREFILL = flags.DEFINE_integer("prefill_tokens", 512, "prefill chunk of the mixed step")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "tokens per KV page")
_KV_PAGES = flags.DEFINE_integer("kv_pages", 0, "KV pages per rank (0: what batch x context "
                                 "needs)")
_SPECULATIVE = flags.DEFINE_integer("speculative", 3, "MTP draft tokens of the speculative "
                                    "step (MTP models; 0: none)")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", None, "compile the preset with this many "
                                   "layers (its dense-first layers as the preset has them)")
_WEIGHTS = flags.DEFINE_enum("weights", "per_layer", ["stacked", "per_layer"],
                             "how the steps hold the weights: per_layer (a GPU Engine's "
                             "default) or stacked (scanned: EngineConfig(unroll_layers=False))")
_HLO_DIR = flags.DEFINE_string("hlo_dir", None, "write each program's optimized HLO text here "
                               "as <program>.hlo")
_JSON_OUT = flags.DEFINE_string("json_out", None, "write the report as JSON here "
                                "(e.g. experiments/results/gpu_plan_<preset>.json)")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  run_gpu_plan(model=_MODEL.value, mesh=_MESH.value, layout=_LAYOUT.value, gpu=_GPU.value,
               hosts=_HOSTS.value, dtype=_DTYPE.value, json_out=_JSON_OUT.value,
               num_layers=_NUM_LAYERS.value, hlo_dir=_HLO_DIR.value, weights=_WEIGHTS.value,
               batch=_BATCH.value, context=_CONTEXT.value, prefill_tokens=_PREFILL.value,
               page_size=_PAGE_SIZE.value, kv_pages=_KV_PAGES.value,
               num_draft_tokens=_SPECULATIVE.value)


if __name__ == "__main__":
  cli.run(main)
