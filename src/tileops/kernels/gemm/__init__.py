from .gemm import GemmConfig, GemmKernel

__all__ = ["GemmConfig", "GemmKernel"]
