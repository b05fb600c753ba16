"""Standalone Pallas kernels, each paired with a pure-jnp `<op>_reference`.

Empty until the kernels issue lands: flash attention (prefill), paged decode
attention, MLA decode and ragged paged attention. This package imports nothing
from `jaxinfer`; `jaxinfer/ops.py` is the only place that picks a kernel.
"""
