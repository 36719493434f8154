from .attention_bwd import AttentionBwdConfig, AttentionBwdKernel
from .attention_fwd import AttentionFwdConfig, AttentionFwdKernel, AttentionVarlenFwdKernel

__all__ = ["AttentionBwdConfig", "AttentionBwdKernel", "AttentionFwdConfig",
           "AttentionFwdKernel", "AttentionVarlenFwdKernel"]
