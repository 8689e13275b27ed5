"""Emulated-cluster benchmarking: slowed links and side-by-side runs."""
