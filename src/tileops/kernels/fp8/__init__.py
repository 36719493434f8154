from .gemm_fp8 import Fp8GemmConfig, Fp8GemmKernel
from .quantize import QuantConfig, QuantizeFp8Kernel

__all__ = ["Fp8GemmConfig", "Fp8GemmKernel", "QuantConfig", "QuantizeFp8Kernel"]
