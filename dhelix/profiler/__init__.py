"""Pairwise overlap profiler (DESIGN §1.4) and the cost-model validation."""
