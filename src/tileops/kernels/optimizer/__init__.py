from .adamw import AdamWConfig, AdamWKernel

__all__ = ["AdamWConfig", "AdamWKernel"]
