from .gemm_fp8 import Fp8GemmConfig, Fp8GemmKernel
from .grouped_gemm_fp8 import GroupedGemmFp8Config, GroupedGemmFp8Kernel
from .quantize import QuantConfig, QuantizeFp8Kernel

__all__ = ["Fp8GemmConfig", "Fp8GemmKernel", "GroupedGemmFp8Config", "GroupedGemmFp8Kernel",
           "QuantConfig", "QuantizeFp8Kernel"]
