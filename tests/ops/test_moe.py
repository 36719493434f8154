"""Mixture-of-experts ops on the GPU (routing, permutation, combine); filled in below."""
