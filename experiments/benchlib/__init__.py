"""Benchmarks that time jaxinfer's pieces against peers and a measured roofline."""
