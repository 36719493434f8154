from .row_norm_bwd import (
    FusedAddRMSNormBwdKernel,
    LayerNormBwdKernel,
    NormBwdConfig,
    RMSNormBwdKernel,
)
from .row_norm_fwd import FusedAddRMSNormKernel, LayerNormKernel, NormConfig, RMSNormKernel

__all__ = ["FusedAddRMSNormBwdKernel", "FusedAddRMSNormKernel", "LayerNormBwdKernel",
           "LayerNormKernel", "NormBwdConfig", "NormConfig", "RMSNormBwdKernel",
           "RMSNormKernel"]
