"""Standalone Pallas kernels, each paired with a pure-jnp `<op>_reference`.

  flash_attention          prefill: GQA, causal (queries aligned to the end), window, sinks,
                           segment ids, Hv != Hqk
  paged_attention          decode / multi-query verify over the page pool: GQA, window, sinks,
                           split-K
  mosaic_paged_attention   the same on Mosaic GPU for Hopper (TMA, wgmma; jax >= 0.11):
                           the module (`available()`, `mosaic_paged_attention(...)`)
  mosaic_mla_attention     MLA decode on Mosaic GPU (two warpgroups)
  mosaic_ragged_attention  a mixed prefill + decode step on Mosaic GPU (work items of 64 rows)
  mla_paged_attention      DeepSeek MLA decode, absorbed form over the latent pool
  ragged_paged_attention   an engine step's mixed prefill + decode batch in one call
  quantized_matmul         weight-only fp8 / int8 / packed 4-bit matmul, dequantized per tile
  quantized_grouped_matmul the same over MoE experts (ragged_dot semantics)
  hstu_attention           DLRMv3's HSTU SiLU attention over packed jagged users (position
                           and time biases, causal + target-aware masks)

This package imports nothing from `jaxinfer`; `jaxinfer/ops.py` picks kernels.
All kernels run on CPU in Pallas interpret mode (`interpret=True`) and lower
through Triton for GPUs (jax 0.10: `plgpu.CompilerParams`); the tests compile
them into H100 and A100 executables at serving shapes on a CPU machine. The
Mosaic GPU kernels run on CPU in Mosaic GPU's own interpret mode (jax >= 0.11).
"""

from pallas_kernels.mla_paged_attention import mla_paged_attention, mla_paged_attention_reference
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_reference)
from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.hstu_attention import hstu_attention, hstu_attention_reference
from pallas_kernels.quantized_grouped_matmul import (quantized_grouped_matmul,
                                                     quantized_grouped_matmul_reference)
from pallas_kernels.quantized_matmul import (dequantize_reference, quantized_matmul,
                                             quantized_matmul_reference)
