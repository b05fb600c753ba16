"""Serving: workers, KV-aware routing, disaggregated prefill/decode, workloads."""
