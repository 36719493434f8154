"""Mixture-of-experts benchmarks (routing, permutation, combine)."""
