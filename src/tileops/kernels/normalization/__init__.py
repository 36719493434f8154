from .rms_norm import RMSNormConfig, RMSNormKernel

__all__ = ["RMSNormConfig", "RMSNormKernel"]
